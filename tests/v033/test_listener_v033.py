"""vLLM 0.33.0: our pull scheduler's side-channel listener under a barrage of
bad queries from raw ZMQ clients, on real sockets at 127.0.0.1 (issue #25).

Runs in the vLLM 0.33 environment. As ``tests/integration/test_listener_live.py``
for 0.21: the listener is ``NixlHMAConnectorScheduler._nixl_handshake_listener``
on a thread, the barrage ``e2e.barrage``; 0.33's queries name the PP and TP
rank and its answers carry prefill's ``perf_counter``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import msgspec
import pytest
import zmq

from vllm_nixl_hma import _compat

if not _compat.builds_on("v033"):
    # this module imports vLLM 0.33's modules at its top; the vLLM 0.21 suite
    # collects tests/v033 and deselects it (marker vllm033): nothing runs there
    pytest.skip("vLLM 0.33's environment only", allow_module_level=True)

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    NixlHandshakePayload,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)

from vllm_nixl_hma.core import listener, side_channel, upstream_contract
from vllm_nixl_hma.e2e import barrage
from vllm_nixl_hma.v033 import listener as glue
from vllm_nixl_hma.v033.listener import NixlHMAConnectorScheduler

pytestmark = pytest.mark.vllm033

HOST = "127.0.0.1"
PAYLOADS = {
    (0, rank): msgspec.msgpack.encode(NixlHandshakePayload(f"hash-{rank}", bytes([rank]) * 40))
    for rank in range(2)
}


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


@pytest.fixture
def records():
    """The listener's log records (vLLM's loggers do not propagate to the root)."""
    caught: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = caught.append
    listener.logger.addHandler(handler)
    yield caught
    listener.logger.removeHandler(handler)


@pytest.fixture
def ours():
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=NixlHMAConnectorScheduler._nixl_handshake_listener,
        args=(dict(PAYLOADS), ready, stop, HOST, port),
        daemon=True,
    )
    thread.start()
    assert ready.wait(5)
    yield port, thread, listener.health_of(stop)
    stop.set()
    thread.join(5)
    assert not thread.is_alive()


def ask_as_vllm_decode(port: int, rank: int) -> list[bytes] | None:
    """vLLM 0.33.0 decode's query: ``(GET_META_MSG, pp_rank, tp_rank)`` on a
    REQ socket; every frame of the answer."""
    query = msgspec.msgpack.encode((GET_META_MSG, 0, rank))
    return side_channel.ask_frames(f"tcp://{HOST}:{port}", query, total_s=5)


def test_a_barrage_leaves_the_listener_answering_real_queries(ours, records):
    port, thread, health = ours
    sent: dict[str, int] = {}
    flood = threading.Thread(target=lambda: sent.update(barrage.barrage(HOST, port, 1000, 20)))
    flood.start()
    during = []
    while flood.is_alive():
        during.append(barrage.handshake_answer(HOST, port, "v033", tp_rank=1, timeout_s=5))
    flood.join()
    assert during and all(frames and frames[0] == PAYLOADS[(0, 1)] for frames in during)
    assert sent["total"] == 1000 and sent["unsent"] == 0
    assert all(sent[kind] > 0 for kind in barrage.KINDS)
    assert sent["dealer_clients"] >= 3 and sent["req_clients"] >= 3
    # every message reached the loop and was dropped, but the oversized: ZMQ dropped those peers
    expected = sent["total"] - sent[barrage.OVERSIZED]
    assert wait_until(lambda: sum(health.dropped.values()) >= expected)
    assert sum(health.dropped.values()) == expected
    assert set(health.dropped) == set(listener.Fault)
    before = time.perf_counter()
    payload, stamp = ask_as_vllm_decode(port, 0)
    assert payload == PAYLOADS[(0, 0)]
    assert before <= msgspec.msgpack.decode(stamp, type=float) <= time.perf_counter()
    assert barrage.handshake_ok(HOST, port, "v033")
    assert thread.is_alive() and health.healthy and health.restarts == 0
    warnings = [record for record in records if record.levelno >= logging.WARNING]
    assert len(warnings) == 1, [record.getMessage() for record in warnings]
    assert "from 127.0.0.1 " in warnings[0].getMessage()
    assert len(warnings[0].getMessage()) < 400


def with_upstream_state(scheduler, port: int) -> None:
    """What upstream's constructor sets that its ``set_xfer_handshake_metadata``
    and ``shutdown`` use (a whole scheduler needs a model config)."""
    scheduler._handshake_data = {}
    scheduler._registration_generation = 0
    scheduler._nixl_handshake_listener_t = None
    scheduler._stop_event = threading.Event()
    scheduler.side_channel_host = HOST
    scheduler.side_channel_port = port


def test_upstreams_scheduler_starts_our_listener(records):
    """``set_xfer_handshake_metadata`` (upstream's) starts the override; a bad
    query does not end it, and ``shutdown`` (upstream's) stops it."""
    scheduler = object.__new__(NixlHMAConnectorScheduler)
    with_upstream_state(scheduler, free_port())
    metadata = {(0, rank): NixlHandshakePayload(f"hash-{rank}", b"agent") for rank in range(2)}
    scheduler.set_xfer_handshake_metadata(metadata)
    try:
        context = zmq.Context()
        try:
            dealer = context.socket(zmq.DEALER)
            dealer.connect(f"tcp://{HOST}:{scheduler.side_channel_port}")
            dealer.send_multipart([b"", b"\xc1"])
            health = listener.health_of(scheduler._stop_event)
            assert wait_until(lambda: health.dropped[listener.Fault.MALFORMED] == 1)
            answer = ask_as_vllm_decode(scheduler.side_channel_port, 1)
            # upstream updates the payloads the listener reads
            scheduler.set_xfer_handshake_metadata({(0, 1): NixlHandshakePayload("new", b"agent")})
            updated = ask_as_vllm_decode(scheduler.side_channel_port, 1)
        finally:
            context.destroy(linger=0)
        assert msgspec.msgpack.decode(answer[0], type=NixlHandshakePayload) == metadata[(0, 1)]
        assert msgspec.msgpack.decode(updated[0], type=NixlHandshakePayload).compatibility_hash == (
            "new"
        )
        # the listener counts a reply after sending it, so the client can read it first
        assert wait_until(lambda: health.answered >= 1)
        assert health.dropped[listener.Fault.MALFORMED] == 1
    finally:
        scheduler.shutdown()
    assert scheduler._nixl_handshake_listener_t is None


def test_a_listener_that_gave_up_fails_the_next_scheduler_step():
    scheduler = object.__new__(NixlHMAConnectorScheduler)
    scheduler._stop_event = threading.Event()
    scheduler.require_listener()
    listener.health_of(scheduler._stop_event).give_up("6 failures within 60 s")
    with pytest.raises(listener.ListenerFailedError, match="no decode can handshake"):
        scheduler.build_connector_meta(None)


def test_a_port_that_cannot_be_bound_fails_startup_instead_of_hanging(records):
    """Upstream's listener thread dies on the bind and its scheduler waits
    for its ready event forever; ours gives up after its restarts (~3 s)."""
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        scheduler = object.__new__(NixlHMAConnectorScheduler)
        with_upstream_state(scheduler, taken.getsockname()[1])
        with pytest.raises(listener.ListenerFailedError, match="Address already in use"):
            scheduler.set_xfer_handshake_metadata({(0, 0): NixlHandshakePayload("hash", b"agent")})
        scheduler.shutdown()
    assert [r.levelno for r in records].count(logging.ERROR) == 1


def test_the_upstream_names_the_override_relies_on_are_there():
    upstream_contract.require(
        NixlPullConnectorScheduler,
        upstream_contract.installed().listener_overrides,
        owner_name="NixlPullConnectorScheduler",
        release="0.33.0",
    )
    listener.require_upstream_listener(
        NixlPullConnectorScheduler,
        glue.LISTENER_PARAMETERS,
        owner_name="NixlPullConnectorScheduler",
        release="0.33.0",
    )
    assert glue.WIRE.get_meta_msg == listener.GET_META_MSG == GET_META_MSG


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_canary_upstreams_listener_dies_of_one_frame_without_a_delimiter():
    """The fault is real: one DEALER message of one frame ends vLLM 0.33.0's
    listener thread, and a real query then goes unanswered."""
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=NixlBaseConnectorScheduler._nixl_handshake_listener,
        args=(dict(PAYLOADS), ready, stop, HOST, port),
        daemon=True,
    )
    thread.start()
    assert ready.wait(5)
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"tcp://{HOST}:{port}")
        dealer.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        thread.join(5)
    finally:
        context.destroy(linger=0)
        stop.set()
    assert not thread.is_alive()
    assert barrage.handshake_answer(HOST, port, "v033", timeout_s=0.5) is None
