"""vLLM 0.33: our worker builds upstream's NIXL agent with the configured
progress-thread delay (real NIXL agents; upstream's constructor reduced to
building its agent as 0.33.0 does, through ``base_worker.NixlWrapper``)."""

from __future__ import annotations

import types
import uuid

import pytest

from tests.agent_cpu import idle_cpu_share

pytestmark = pytest.mark.vllm033


@pytest.fixture
def upstream_constructor(mocker):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    from vllm_nixl_hma.core import upstream_contract

    built = []

    def builds_its_agent(self, vllm_config, engine_id, kv_cache_config):
        config = base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True)
        self.nixl_wrapper = base_worker.NixlWrapper(str(uuid.uuid4()), config)
        built.append(self.nixl_wrapper)
        self.kv_transfer_config = vllm_config.kv_transfer_config
        for name in upstream_contract.V033.worker_state:
            if not hasattr(self, name):
                setattr(self, name, None)
        self._has_mamba = False

    mocker.patch.object(NixlPullConnectorWorker, "__init__", builds_its_agent)
    return built


def config_with(extra_config):
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra_config)
    )


def test_the_configured_delay_stops_the_agents_progress_thread_spinning(upstream_constructor):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    from vllm_nixl_hma.v033.worker import NixlHMAConnectorWorker

    upstream_agent_cls = base_worker.NixlWrapper
    with_delay, _ = idle_cpu_share(
        lambda: NixlHMAConnectorWorker(config_with({"progress_thread_delay_us": 1000}), "e", None)
    )
    assert base_worker.NixlWrapper is upstream_agent_cls  # put back
    as_nixl_builds_it, _ = idle_cpu_share(
        lambda: NixlHMAConnectorWorker(config_with({}), "e", None)
    )
    assert as_nixl_builds_it > 4 * with_delay, (as_nixl_builds_it, with_delay)


def test_a_bad_delay_is_refused_before_any_agent_exists(upstream_constructor):
    from vllm_nixl_hma.v033.worker import NixlHMAConnectorWorker

    with pytest.raises(ValueError, match="progress_thread_delay_us=-5"):
        NixlHMAConnectorWorker(config_with({"progress_thread_delay_us": -5}), "e", None)
    assert upstream_constructor == []


def test_ucx_settings_are_applied_before_upstream_builds_the_agent(mocker, monkeypatch):
    """#43: the plugin's UCX default is in the environment when upstream's
    constructor builds the agent (UCX reads it then); the operator's stays."""
    import os

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    from vllm_nixl_hma.v033.worker import NixlHMAConnectorWorker

    seen = []

    def upstream_init(self, vllm_config, engine_id, kv_cache_config):
        seen.append(os.environ.get("UCX_KEEPALIVE_INTERVAL"))
        raise RuntimeError("stop here")  # the agent would be built now

    mocker.patch.object(NixlPullConnectorWorker, "__init__", upstream_init)
    monkeypatch.delenv("UCX_KEEPALIVE_INTERVAL", raising=False)
    with pytest.raises(RuntimeError, match="stop here"):
        NixlHMAConnectorWorker(config_with({}), "e", None)
    monkeypatch.setenv("UCX_KEEPALIVE_INTERVAL", "3s")
    with pytest.raises(RuntimeError, match="stop here"):
        NixlHMAConnectorWorker(config_with({}), "e", None)
    assert seen == ["100ms", "3s"]
    with pytest.raises(ValueError, match="slow_read_s=-1"):
        NixlHMAConnectorWorker(config_with({"slow_read_s": -1}), "e", None)
    assert len(seen) == 2  # refused before upstream's constructor
