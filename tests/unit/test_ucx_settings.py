"""The UCX settings the connector applies before NIXL builds its agent
(core/ucx_settings.py, #43), and that each release's worker applies them
before upstream's constructor builds the agent."""

from __future__ import annotations

import types

import pytest

from vllm_nixl_hma.core import ucx_settings


def test_an_unset_setting_gets_the_plugins_default():
    environ = {"UCX_TLS": "tcp"}
    applied = ucx_settings.apply(environ)
    assert environ == {"UCX_TLS": "tcp", "UCX_KEEPALIVE_INTERVAL": "100ms"}
    assert applied == [ucx_settings.Applied("UCX_KEEPALIVE_INTERVAL", "100ms", "plugin")]
    line = ucx_settings.describe(applied)
    assert "UCX_KEEPALIVE_INTERVAL=100ms (the plugin default)" in line


@pytest.mark.parametrize("value", ["20s", ""])
def test_the_operators_setting_is_kept_whatever_it_is(value):
    environ = {"UCX_KEEPALIVE_INTERVAL": value}
    applied = ucx_settings.apply(environ)
    assert environ == {"UCX_KEEPALIVE_INTERVAL": value}
    assert applied == [ucx_settings.Applied("UCX_KEEPALIVE_INTERVAL", value, "operator")]
    assert f"UCX_KEEPALIVE_INTERVAL={value} (yours)" in ucx_settings.describe(applied)


def test_the_021_worker_sets_it_before_upstreams_constructor_builds_the_agent(mocker, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

    from vllm_nixl_hma.v021.worker import NixlHMAConnectorWorker

    seen = []

    def upstream_init(self, vllm_config, engine_id, kv_cache_config):
        import os

        seen.append(os.environ.get("UCX_KEEPALIVE_INTERVAL"))
        raise RuntimeError("stop here")  # the agent would be built now

    mocker.patch.object(NixlConnectorWorker, "__init__", upstream_init)
    config = types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config={})
    )
    monkeypatch.delenv("UCX_KEEPALIVE_INTERVAL", raising=False)
    with pytest.raises(RuntimeError, match="stop here"):
        NixlHMAConnectorWorker(config, "e", None)
    monkeypatch.setenv("UCX_KEEPALIVE_INTERVAL", "3s")
    with pytest.raises(RuntimeError, match="stop here"):
        NixlHMAConnectorWorker(config, "e", None)
    assert seen == ["100ms", "3s"]


def test_a_bad_slow_read_s_stops_the_021_worker_before_any_agent(mocker):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

    from vllm_nixl_hma.v021.worker import NixlHMAConnectorWorker

    upstream_init = mocker.patch.object(NixlConnectorWorker, "__init__")
    config = types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config={"slow_read_s": 0})
    )
    with pytest.raises(ValueError, match="slow_read_s=0"):
        NixlHMAConnectorWorker(config, "e", None)
    upstream_init.assert_not_called()
