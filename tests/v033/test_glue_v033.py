"""The plugin on vLLM 0.33 and 0.34: which glue loads, and what the 0.21-only
parts leave alone (#13, #42).

Runs in the vLLM 0.33 and 0.34 environments (tools/env.sh v033, v034).
"""

from __future__ import annotations

import json

import pytest

from vllm_nixl_hma import _compat, plugin
from vllm_nixl_hma.core.errors import UnsupportedVersionError
from vllm_nixl_hma.harness import layout
from vllm_nixl_hma.harness.model_shapes import LAYOUTS_V033
from vllm_nixl_hma.v021 import config_hook

pytestmark = pytest.mark.vllm033


#: the installed release's glue: v033, or v034 (written as a difference from v033)
GLUE = _compat.adapter()


def test_the_installed_vllm_is_033_or_034_and_gets_its_glue():
    release = {"v033": "0.33.", "v034": "0.34."}[GLUE]
    assert _compat.installed_vllm_version().startswith(release)
    assert _compat.builds_on("v033")
    assert plugin.connector_module() == f"vllm_nixl_hma.{GLUE}.connector"


def test_the_name_resolves_to_our_pull_connector_with_our_worker():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    plugin.register()
    plugin.register()  # idempotent: the factory raises on a duplicate name
    connector_cls = KVConnectorFactory._registry[plugin.CONNECTOR_NAME]()
    assert connector_cls.__module__ == f"vllm_nixl_hma.{GLUE}.connector"
    assert issubclass(connector_cls, NixlPullConnector)
    assert issubclass(connector_cls.worker_cls, NixlPullConnectorWorker)
    assert connector_cls.worker_cls.__module__ == f"vllm_nixl_hma.{GLUE}.worker"


def test_the_021_glue_refuses_to_import_here():
    with pytest.raises(UnsupportedVersionError, match="glue for vLLM >=0.21.0,<0.22"):
        import vllm_nixl_hma.v021.connector  # noqa: F401


@pytest.fixture(scope="module")
def hybrid_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("granite")
    (root / "config.json").write_text(json.dumps(LAYOUTS_V033["hybrid-1group"]))
    config = layout.build_vllm_config(
        str(root),
        1,
        "NixlHMAConnector",
        "engine-0",
        "kv_consumer",
        64,
        512,
        enable_prefix_caching=True,
    )
    return config


def test_the_config_hook_leaves_a_033_hybrid_config_alone(hybrid_config):
    """0.33 serves prefix caching of a Mamba hybrid at equal TP and fails
    multi-group requests itself: the hook must not take either away."""
    assert config_hook.selects_this_connector(hybrid_config)
    assert hybrid_config.model_config.is_hybrid
    assert hybrid_config.cache_config.enable_prefix_caching is True
    scheduler_cls = hybrid_config.scheduler_config.scheduler_cls
    assert scheduler_cls is None or "vllm_nixl_hma" not in str(scheduler_cls)
    config_hook.apply(hybrid_config)  # a second pass changes nothing either
    assert hybrid_config.cache_config.enable_prefix_caching is True


@pytest.mark.parametrize("advertised", ["0.0.0.0", "127.0.0.1"])
def test_a_prefill_host_that_names_decodes_own_machine_is_refused_before_dialing(
    mocker, monkeypatch, advertised
):
    """On 0.33 as on 0.21: decode on a network refuses to dial a wildcard or
    loopback side-channel host, naming the setting, before upstream's
    handshake opens a socket."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    from vllm_nixl_hma.core.handshake import HandshakeError
    from vllm_nixl_hma.v033.worker import NixlHMAConnectorWorker

    upstream = mocker.patch.object(NixlPullConnectorWorker, "_nixl_handshake")
    worker = object.__new__(NixlHMAConnectorWorker)
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.201.7.3")
    with pytest.raises(HandshakeError, match="VLLM_NIXL_SIDE_CHANNEL_HOST"):
        worker._nixl_handshake(advertised, 5600, 2, "prefill-engine")
    upstream.assert_not_called()
    # on one host (decode's own side channel on loopback) upstream dials as before
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    worker._nixl_handshake(advertised, 5600, 2, "prefill-engine", remote_dcp_size=1)
    upstream.assert_called_once_with(advertised, 5600, 2, "prefill-engine", remote_dcp_size=1)


def test_loopback_only_ucx_is_refused_before_dialing_a_prefill_on_another_host(mocker, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    from vllm_nixl_hma.core.handshake import HandshakeError
    from vllm_nixl_hma.v033.worker import NixlHMAConnectorWorker

    upstream = mocker.patch.object(NixlPullConnectorWorker, "_nixl_handshake")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    with pytest.raises(HandshakeError, match="UCX_NET_DEVICES"):
        object.__new__(NixlHMAConnectorWorker)._nixl_handshake("10.201.7.4", 5600, 2, "p")
    upstream.assert_not_called()


def test_a_read_in_flight_past_read_timeout_fails_and_a_younger_one_stays(mocker):
    """0.33's heartbeats keep extending prefill's lease while decode waits, so
    a read left in flight by a vanished prefill host is bounded only by
    ``read_timeout_s``: past it, upstream's own failed-transfer path (engine
    marked failed, handle released) ends the request."""
    import time
    import types

    from vllm_nixl_hma.v033.worker import NixlHMAConnectorWorker

    worker = object.__new__(NixlHMAConnectorWorker)
    worker.nixl_wrapper = mocker.Mock()
    worker.nixl_wrapper.check_xfer_state.return_value = "PROC"
    worker.xfer_stats = mocker.Mock()
    worker._failed_remote_engines = set()
    worker._read_timeout_s = 30.0
    remote = types.SimpleNamespace(engine_id="prefill", request_id="p-1", blocks_expiry_time=None)
    worker._recving_metadata = {
        "old": types.SimpleNamespace(remote=remote),
        "young": types.SimpleNamespace(remote=remote),
    }
    worker._reads_posted_at.update(old=time.perf_counter() - 31, young=time.perf_counter())
    transfers = {"old": [71], "young": [72]}
    done, failed = worker._pop_done_transfers(transfers)
    assert (done, failed) == ({"old"}, {"old"})
    assert transfers == {"young": [72]}
    worker.nixl_wrapper.release_xfer_handle.assert_called_once_with(71)
    assert worker._failed_remote_engines == {"prefill"}


def test_a_read_in_flight_past_slow_read_s_is_counted_logged_once_and_kept_on_033(mocker):
    """#43 on 0.33's glue: a read past ``slow_read_s`` but short of
    ``read_timeout_s`` stays in flight; it is counted once in the connector
    stats and logged once with NIXL's state; a younger read is not."""
    import time
    import types

    from vllm_nixl_hma import request_records
    from vllm_nixl_hma.core.transfer_records import DECODE_SLOW_READS
    from vllm_nixl_hma.transfer_stats import NixlHMAKVConnectorStats
    from vllm_nixl_hma.v033.worker import NixlHMAConnectorWorker

    worker = object.__new__(NixlHMAConnectorWorker)
    worker.nixl_wrapper = mocker.Mock()
    worker.nixl_wrapper.check_xfer_state.return_value = "PROC"
    worker.xfer_stats = NixlHMAKVConnectorStats()
    worker._failed_remote_engines = set()
    worker._read_timeout_s = 30.0
    worker._slow_read_s = 2.0
    warning = mocker.patch.object(request_records.logger, "warning")
    remote = types.SimpleNamespace(engine_id="prefill", request_id="p-1", blocks_expiry_time=None)
    worker._recving_metadata = {
        "old": types.SimpleNamespace(remote=remote),
        "young": types.SimpleNamespace(remote=remote),
    }
    for request_id in ("old", "young"):
        spec = types.SimpleNamespace(remote_rank=0, local_block_ids=[[1, 2]])
        worker._note_read(spec, "prefill", request_id)
    worker._reads_posted_at.update(old=time.perf_counter() - 3, young=time.perf_counter())
    transfers = {"old": [71], "young": [72]}
    for _ in range(3):
        assert worker._pop_done_transfers(transfers) == (set(), set())
    assert transfers == {"old": [71], "young": [72]}
    assert worker.xfer_stats.data[DECODE_SLOW_READS] == [1]
    (message,) = [call.args[0] for call in warning.call_args_list]
    assert "old" in message and "2 kernel blocks" in message and "PROC" in message
