"""The check harness across hosts: rank processes inside the network namespaces
of ``e2e.netns``, as ``benchmarks/link.py`` runs them (#23 item 5).

Prefill TP 2 (both ranks on the prefill host) -> decode TP 1 (on the decode
host) on the hybrid at unequal ratios, ours: every slot right, the side
channel on the control network, and the KV over the data link (each host's
data interface counted the bytes decode read). Runs as root, as CI does here.
"""

from __future__ import annotations

import os

import pytest

from vllm_nixl_hma.e2e import netns
from vllm_nixl_hma.harness import coordinator
from vllm_nixl_hma.harness.model_shapes import LAYOUTS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)"),
]


def test_ranks_on_separate_hosts_read_every_slot_over_the_data_link(tmp_path):
    model_dir = coordinator.model_dir_for(LAYOUTS["hybrid"], tmp_path)
    with netns.Topology(["prefill", "decode"], link_rate="2gbit") as topology:
        prefill, decode = topology.hosts["prefill"], topology.hosts["decode"]
        cell = coordinator.Cell(
            "hybrid",
            model_dir,
            p_tp=2,
            d_tp=1,
            connector="NixlHMAConnector",
            scenarios=[coordinator.Scenario("mid-block"), coordinator.Scenario("long")],
            num_gpu_blocks=8192,  # the long batch takes about 6000 of prefill's
            prefill_host=prefill.control_address,
            decode_host=decode.control_address,
        )
        before = {
            (host, network): topology.counters(host, network)
            for host in ("prefill", "decode")
            for network in ("data", "control")
        }
        results = coordinator.run_cells(
            [cell],
            progress=lambda line: None,
            env={"UCX_NET_DEVICES": "eth0", "UCX_TLS": "tcp"},
            namespaces=[prefill.namespace, prefill.namespace, decode.namespace],
        )
        moved = {
            key: {
                direction: topology.counters(*key)[direction] - count
                for direction, count in counts.items()
            }
            for key, counts in before.items()
        }
    for result in results:
        assert result.error is None, result.error
        assert result.slots_checked > 100_000
        assert result.mismatched_slots == 0, result.examples
        assert result.local_ratio != result.remote_ratio
    kv_bytes = sum(result.bytes for result in results)
    assert kv_bytes > 20 << 20  # the long batch: tens of MiB, not a handful of pages
    # the KV left the prefill host and reached the decode host over the data link
    assert kv_bytes <= moved[("prefill", "data")]["tx_bytes"] < 1.2 * kv_bytes
    assert kv_bytes <= moved[("decode", "data")]["rx_bytes"] < 1.2 * kv_bytes
    # the side channel (control network) carried metadata, not the KV
    assert 0 < moved[("prefill", "control")]["tx_bytes"] < kv_bytes / 20
