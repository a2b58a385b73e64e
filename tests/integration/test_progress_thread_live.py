"""NIXL agents built with a progress-thread delay (real NIXL agents): an idle
one stops spinning a core, and a read from an owner that never calls NIXL
itself (as an idle prefill engine does not) still completes, byte for byte.

The CPU figures are compared with each other in one run, not with a fixed
time, and count only the threads the measured agent started (agents other
tests left in the process spin too): an agent as NIXL builds it polls
without pause (a full core when the host has one free); the delayed one
blocks in ``poll`` between UCX events.
"""

from __future__ import annotations

import time
import types
import uuid

import pytest
from nixl._api import nixl_agent, nixl_agent_config
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import worker as upstream_worker_module
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

from tests.agent_cpu import idle_cpu_share
from vllm_nixl_hma import NixlHMAConnectorWorker
from vllm_nixl_hma.core import upstream_contract
from vllm_nixl_hma.core.progress_thread import agents_built_with_delay
from vllm_nixl_hma.v021.worker import build_nixl_agent


def vllm_like_config():
    return nixl_agent_config(num_threads=4, capture_telemetry=True)


def test_an_idle_agent_with_a_delay_stops_spinning_a_core():
    as_nixl_builds_it, _ = idle_cpu_share(
        lambda: nixl_agent(f"spins-{uuid.uuid4()}", vllm_like_config())
    )

    def delayed():
        with agents_built_with_delay(nixl_agent, 1000):
            return nixl_agent(f"waits-{uuid.uuid4()}", vllm_like_config())

    with_delay, _ = idle_cpu_share(delayed)
    # measured on the 2-core CI host: 1.0 and 0.02 cores
    assert as_nixl_builds_it > 4 * with_delay, (as_nixl_builds_it, with_delay)
    assert with_delay < 0.25, with_delay


def test_a_read_from_an_idle_owner_completes_with_delayed_progress_threads():
    """The owner of the bytes never calls NIXL during the read: only its
    progress thread serves it, as an idle prefill engine's does."""
    import numpy as np
    import torch

    reader = build_nixl_agent(
        nixl_agent, f"reader-{uuid.uuid4()}", vllm_like_config(), 8, progress_delay_us=1000
    )
    with agents_built_with_delay(nixl_agent, 1000):
        owner = nixl_agent(f"owner-{uuid.uuid4()}", vllm_like_config())
    count, size = 64, 16384
    source = torch.randint(1, 256, (count * size,), dtype=torch.uint8)
    target = torch.zeros(count * size, dtype=torch.uint8)
    registrations = [
        (owner, owner.register_memory(owner.get_reg_descs([source]))),
        (reader, reader.register_memory(reader.get_reg_descs([target]))),
    ]
    name = reader.add_remote_agent(owner.get_agent_metadata())
    order = np.random.default_rng(5).permutation(count)

    def descs(tensor, slots):
        rows = np.zeros((count, 3), dtype=np.int64)
        rows[:, 0] = tensor.data_ptr() + slots * size
        rows[:, 1] = size
        return rows

    try:
        handle = reader.initialize_xfer(
            "READ",
            reader.get_xfer_descs(descs(target, np.arange(count)), "DRAM"),
            owner.get_xfer_descs(descs(source, order), "DRAM"),
            name,
        )
        reader.transfer(handle)
        deadline = time.monotonic() + 30
        while (state := reader.check_xfer_state(handle)) == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
        reader.release_xfer_handle(handle)
        assert state == "DONE"
        got = target.numpy().reshape(count, size)
        assert np.array_equal(got, source.numpy().reshape(count, size)[order])
    finally:
        reader.remove_remote_agent(name)
        for agent, registered in registrations:
            agent.deregister_memory(registered)


@pytest.fixture
def upstream_constructor(mocker):
    """Upstream's constructor, reduced to building its agent as 0.21.0 does."""
    built = []

    def builds_its_agent(self, vllm_config, engine_id, kv_cache_config):
        config = upstream_worker_module.nixl_agent_config(num_threads=4, capture_telemetry=True)
        self.nixl_wrapper = upstream_worker_module.NixlWrapper(str(uuid.uuid4()), config)
        built.append(self.nixl_wrapper)
        for name in upstream_contract.V021.worker_state:
            if not hasattr(self, name):
                setattr(self, name, set() if name == "_failed_recv_reqs" else None)

    mocker.patch.object(NixlConnectorWorker, "__init__", builds_its_agent)
    return built


def config_with(extra_config):
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra_config)
    )


def test_our_worker_builds_its_agent_with_the_configured_delay(upstream_constructor):
    upstream_agent_cls = upstream_worker_module.NixlWrapper
    with_delay, _ = idle_cpu_share(
        lambda: NixlHMAConnectorWorker(
            config_with({"progress_thread_delay_us": 1000}), "engine", None
        )
    )
    as_nixl_builds_it, _ = idle_cpu_share(
        lambda: NixlHMAConnectorWorker(config_with({}), "engine", None)
    )
    assert as_nixl_builds_it > 4 * with_delay, (as_nixl_builds_it, with_delay)
    assert upstream_worker_module.NixlWrapper is upstream_agent_cls  # put back


def test_a_bad_delay_is_refused_before_any_agent_exists(upstream_constructor):
    with pytest.raises(ValueError, match="progress_thread_delay_us='1ms'"):
        NixlHMAConnectorWorker(config_with({"progress_thread_delay_us": "1ms"}), "engine", None)
    assert upstream_constructor == []
