"""``NixlHMAConnectorWorker._nixl_handshake`` asks through vLLM's own socket
helper (``zmq_ctx`` in vLLM's worker module), so that whatever vLLM's sockets
do, ours do, and a test that stands in for vLLM's socket stands in for ours.
"""

from __future__ import annotations

import contextlib
import types

import msgspec
import pytest
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import worker as upstream_worker_module
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG

from tests.property.test_handshake_fuzz import ENGINE, HASH, stock_payload, valid_outer
from tests.unit.test_handshake import record
from vllm_nixl_hma.core.handshake import PAYLOAD_FIELD, CompatibilityHashMismatch, encode_record
from vllm_nixl_hma.v021.worker import NixlHMAConnectorWorker


class AnsweringSocket:
    """Stands in for the REQ socket vLLM's ``zmq_ctx`` yields."""

    def __init__(self, answer: bytes):
        self.answer = answer
        self.sent: list[bytes] = []
        self.options: dict[int, int] = {}

    def setsockopt(self, option, value):
        self.options[option] = value

    def send(self, message):
        self.sent.append(message)

    def recv(self):
        return self.answer


@pytest.fixture
def worker(mocker):
    w = object.__new__(NixlHMAConnectorWorker)
    w.compat_hash = HASH
    w.enforce_compat_hash = True
    w._handshake_record = record()
    w.use_host_buffer = True
    w.transfer_topo = types.SimpleNamespace(handshake_target_ranks=lambda remote_tp: [0])
    w.__dict__["_side_channel_timeout_s"] = 1.0
    mocker.patch.object(NixlHMAConnectorWorker, "add_remote_agent", return_value="remote-agent")
    return w


def serve(mocker, answer: bytes) -> list:
    opened = []

    @contextlib.contextmanager
    def zmq_ctx(socket_type, path):
        sock = AnsweringSocket(answer)
        opened.append((socket_type, path, sock))
        yield sock

    mocker.patch.object(upstream_worker_module, "zmq_ctx", zmq_ctx)
    return opened


@pytest.mark.parametrize("peer", ["ours", "stock"])
def test_the_handshake_asks_through_vllms_socket_helper(worker, mocker, peer):
    answer = msgspec.msgpack.encode(valid_outer()) if peer == "ours" else stock_payload()
    opened = serve(mocker, answer)
    assert worker._nixl_handshake("127.0.0.1", 5600, 1, ENGINE) == {0: "remote-agent"}
    [(socket_type, path, sock)] = opened
    assert (socket_type, path) == (zmq.REQ, "tcp://127.0.0.1:5600")
    assert sock.sent == [msgspec.msgpack.encode((GET_META_MSG, 0))]
    assert sock.options[zmq.RCVTIMEO] == 500  # the first attempt of the 1 s


def test_a_mismatched_hash_is_refused_with_vllms_message_before_any_agent(worker, mocker):
    outer = valid_outer()
    outer["compatibility_hash"] = "another"
    serve(mocker, msgspec.msgpack.encode(outer))
    with pytest.raises(CompatibilityHashMismatch, match="compatibility hash mismatch"):
        worker._nixl_handshake("127.0.0.1", 5600, 1, ENGINE)
    NixlHMAConnectorWorker.add_remote_agent.assert_not_called()


@pytest.mark.parametrize("advertised", ["0.0.0.0", "127.0.0.1", "::", "localhost"])
def test_a_prefill_host_that_names_decodes_own_machine_is_refused_before_dialing(
    worker, mocker, monkeypatch, advertised
):
    """Across hosts (decode's own side channel on a routable address), a
    wildcard or loopback ``remote_host`` would make decode dial itself: refused
    naming the setting and both values, with no socket opened."""
    from vllm_nixl_hma.core.handshake import HandshakeError

    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.201.7.3")
    opened = serve(mocker, stock_payload())
    with pytest.raises(HandshakeError, match="VLLM_NIXL_SIDE_CHANNEL_HOST") as refused:
        worker._nixl_handshake(advertised, 5600, 1, ENGINE)
    assert (refused.value.local, refused.value.remote) == ("10.201.7.3", advertised)
    assert opened == []
    NixlHMAConnectorWorker.add_remote_agent.assert_not_called()


def test_on_one_host_a_loopback_prefill_host_is_dialed(worker, mocker, monkeypatch):
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    opened = serve(mocker, stock_payload())
    assert worker._nixl_handshake("127.0.0.1", 5600, 1, ENGINE) == {0: "remote-agent"}
    assert len(opened) == 1


def test_loopback_only_ucx_is_refused_before_dialing_a_prefill_on_another_host(
    worker, mocker, monkeypatch
):
    from vllm_nixl_hma.core.handshake import HandshakeError

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    opened = serve(mocker, stock_payload())
    with pytest.raises(HandshakeError, match="UCX_NET_DEVICES") as refused:
        worker._nixl_handshake("10.201.7.4", 5600, 1, ENGINE)
    assert refused.value.local == "lo"
    assert opened == []


def test_a_hash_mismatch_from_two_model_paths_names_both_paths(worker, mocker):
    """The same weights under two paths: vLLM's hash includes the path and
    its message does not say so. Ours keeps vLLM's message and names the
    paths, before any agent is registered."""
    worker._handshake_record = record(model="/models/qwen3-next")
    outer = valid_outer()
    outer["compatibility_hash"] = "another"
    outer[PAYLOAD_FIELD] = encode_record(record(model="/data/weights/qwen3-next"))
    serve(mocker, msgspec.msgpack.encode(outer))
    with pytest.raises(CompatibilityHashMismatch) as refused:
        worker._nixl_handshake("127.0.0.1", 5600, 1, ENGINE)
    message = str(refused.value)
    assert message.startswith("NIXL compatibility hash mismatch.")
    assert "'/models/qwen3-next'" in message and "'/data/weights/qwen3-next'" in message
    assert refused.value.field.startswith("model")
    assert (refused.value.local, refused.value.remote) == (
        "/models/qwen3-next",
        "/data/weights/qwen3-next",
    )
    NixlHMAConnectorWorker.add_remote_agent.assert_not_called()


def test_a_hash_mismatch_with_the_same_path_keeps_vllms_fields(worker, mocker):
    worker._handshake_record = record(model="/models/m")
    outer = valid_outer()
    outer["compatibility_hash"] = "another"
    outer[PAYLOAD_FIELD] = encode_record(record(model="/models/m"))
    serve(mocker, msgspec.msgpack.encode(outer))
    with pytest.raises(CompatibilityHashMismatch) as refused:
        worker._nixl_handshake("127.0.0.1", 5600, 1, ENGINE)
    assert refused.value.field == "compatibility_hash"
    assert "--model paths" not in str(refused.value)
