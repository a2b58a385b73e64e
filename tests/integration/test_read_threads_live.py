"""Our worker's NIXL agent splits reads over NIXL's threads (real NIXL agents).

Upstream's constructor builds the agent from the name ``NixlWrapper`` in its
module; here it is replaced by a stand-in that builds it the way vLLM 0.21.0
does (UCX alone, ``num_threads`` 4, telemetry), so that what is checked is
what our constructor makes of that call.
"""

from __future__ import annotations

import time
import types
import uuid

import pytest
from nixl._api import nixl_agent, nixl_agent_config
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import worker as upstream_worker_module
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

from vllm_nixl_hma import NixlHMAConnectorWorker
from vllm_nixl_hma.core import upstream_contract
from vllm_nixl_hma.core.read_threads import DEFAULT_SPLIT_BATCH_SIZE
from vllm_nixl_hma.v021.worker import build_nixl_agent


def vllm_config(extra_config):
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra_config)
    )


@pytest.fixture
def upstream_constructor(mocker):
    """Upstream's constructor, reduced to building its agent as 0.21.0 does."""
    calls = []

    def builds_its_agent(self, vllm_config, engine_id, kv_cache_config):
        calls.append(engine_id)
        config = upstream_worker_module.nixl_agent_config(num_threads=4, capture_telemetry=True)
        self.nixl_wrapper = upstream_worker_module.NixlWrapper(str(uuid.uuid4()), config)
        # the rest of upstream's state, which our worker requires after the
        # constructor (upstream_contract); none of it is used here
        for name in upstream_contract.V021.worker_state:
            if not hasattr(self, name):
                setattr(self, name, set() if name == "_failed_recv_reqs" else None)

    mocker.patch.object(NixlConnectorWorker, "__init__", builds_its_agent)
    return calls


def ucx_params(worker):
    return worker.nixl_wrapper.get_backend_params("UCX")


def test_our_worker_asks_nixl_to_split_reads_and_stock_does_not(upstream_constructor):
    upstream_agent_cls = upstream_worker_module.NixlWrapper
    ours = NixlHMAConnectorWorker(vllm_config({}), "engine", None)
    assert ucx_params(ours) == {
        "num_threads": "4",
        "split_batch_size": str(DEFAULT_SPLIT_BATCH_SIZE),
    }
    assert upstream_worker_module.NixlWrapper is upstream_agent_cls  # put back
    stock = NixlConnectorWorker(vllm_config({}), "engine", None)
    assert ucx_params(stock) == {"num_threads": "4"}


def test_the_user_sets_the_split(upstream_constructor):
    ours = NixlHMAConnectorWorker(vllm_config({"split_batch_size": "8"}), "engine", None)
    assert ucx_params(ours)["split_batch_size"] == "8"


def test_a_bad_split_is_refused_before_any_agent_exists(upstream_constructor):
    with pytest.raises(ValueError, match="split_batch_size='eight'"):
        NixlHMAConnectorWorker(vllm_config({"split_batch_size": "eight"}), "engine", None)
    assert upstream_constructor == []


@pytest.mark.parametrize("value", [0, "30s"])
def test_a_bad_read_timeout_is_refused_before_any_agent_exists(upstream_constructor, value):
    with pytest.raises(ValueError, match=f"read_timeout_s={value!r}"):
        NixlHMAConnectorWorker(vllm_config({"read_timeout_s": value}), "engine", None)
    assert upstream_constructor == []


def test_a_split_agent_reads_every_chunk():
    """NIXL splits a read of more than ``split_batch_size`` descriptors into
    chunks on several threads; every chunk lands (raw NIXL, 100 descriptors
    in chunks of 8)."""
    import numpy as np
    import torch

    config = nixl_agent_config(num_threads=4)
    reader = build_nixl_agent(nixl_agent, f"reader-{uuid.uuid4()}", config, 8)
    owner = nixl_agent(f"owner-{uuid.uuid4()}", config)
    count, size = 100, 4096
    source = torch.randint(1, 256, (2 * count * size,), dtype=torch.uint8)
    target = torch.zeros(2 * count * size, dtype=torch.uint8)
    registrations = [
        (owner, owner.register_memory(owner.get_reg_descs([source]))),
        (reader, reader.register_memory(reader.get_reg_descs([target]))),
    ]
    name = reader.add_remote_agent(owner.get_agent_metadata())
    rng = np.random.default_rng(3)
    target_slots = rng.choice(2 * count, count, replace=False)
    source_slots = rng.choice(2 * count, count, replace=False)

    def descs(tensor, slots):
        rows = np.zeros((count, 3), dtype=np.int64)
        rows[:, 0] = tensor.data_ptr() + slots * size
        rows[:, 1] = size
        return rows

    try:
        handle = reader.initialize_xfer(
            "READ",
            reader.get_xfer_descs(descs(target, target_slots), "DRAM"),
            owner.get_xfer_descs(descs(source, source_slots), "DRAM"),
            name,
        )
        reader.transfer(handle)
        deadline = time.monotonic() + 30
        while (state := reader.check_xfer_state(handle)) == "PROC" and time.monotonic() < deadline:
            pass
        reader.release_xfer_handle(handle)
        assert state == "DONE"
        got = target.numpy().reshape(2 * count, size)[target_slots]
        sent = source.numpy().reshape(2 * count, size)[source_slots]
        assert np.array_equal(got, sent)
        untouched = np.setdiff1d(np.arange(2 * count), target_slots)
        assert not target.numpy().reshape(2 * count, size)[untouched].any()
    finally:
        reader.remove_remote_agent(name)
        for agent, registered in registrations:
            agent.deregister_memory(registered)


def test_ucx_net_devices_naming_a_device_this_host_lacks_stops_startup(
    upstream_constructor, monkeypatch
):
    monkeypatch.setenv("UCX_NET_DEVICES", "eth9")
    with pytest.raises(ValueError, match="UCX_NET_DEVICES='eth9' names eth9"):
        NixlHMAConnectorWorker(vllm_config({}), "engine", None)
    assert upstream_constructor == []
