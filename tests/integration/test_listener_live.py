"""vLLM 0.21.0: our scheduler's side-channel listener under a barrage of bad
queries from raw ZMQ clients, on real sockets at 127.0.0.1 (issue #25).

The listener is ``NixlHMAConnectorScheduler._nixl_handshake_listener`` on a
thread, as upstream's ``set_xfer_handshake_metadata`` starts it; the barrage
is ``e2e.barrage``, the one the e2e run throws at a live prefill. A canary
shows that upstream's own listener dies of one such query.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import msgspec
import pytest
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    NixlHandshakePayload,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import NixlConnectorScheduler

from vllm_nixl_hma.core import listener, side_channel, upstream_contract
from vllm_nixl_hma.e2e import barrage
from vllm_nixl_hma.v021 import listener as glue
from vllm_nixl_hma.v021.listener import NixlHMAConnectorScheduler

HOST = "127.0.0.1"
PAYLOADS = {
    rank: msgspec.msgpack.encode(NixlHandshakePayload(f"hash-{rank}", bytes([rank]) * 40))
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


@pytest.fixture(autouse=True)
def side_channel_host(monkeypatch):
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", HOST)


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
        args=(dict(PAYLOADS), ready, stop, port),
        daemon=True,
    )
    thread.start()
    assert ready.wait(5)
    yield port, thread, listener.health_of(stop)
    stop.set()
    thread.join(5)
    assert not thread.is_alive()


def ask_as_vllm_decode(port: int, rank: int) -> bytes | None:
    """vLLM 0.21.0 decode's query: ``(GET_META_MSG, rank)`` on a REQ socket."""
    query = msgspec.msgpack.encode((GET_META_MSG, rank))
    return side_channel.ask(f"tcp://{HOST}:{port}", query, total_s=5)


def test_a_barrage_leaves_the_listener_answering_real_queries(ours, records):
    port, thread, health = ours
    sent: dict[str, int] = {}
    flood = threading.Thread(target=lambda: sent.update(barrage.barrage(HOST, port, 1000, 20)))
    flood.start()
    during = []
    while flood.is_alive():
        during.append(barrage.handshake_answer(HOST, port, "v021", tp_rank=1, timeout_s=5))
    flood.join()
    assert during and all(frames == [PAYLOADS[1]] for frames in during)
    assert sent["total"] == 1000 and sent["unsent"] == 0
    assert all(sent[kind] > 0 for kind in barrage.KINDS)
    assert sent["dealer_clients"] >= 3 and sent["req_clients"] >= 3
    # every message reached the loop and was dropped, but the oversized: ZMQ dropped those peers
    expected = sent["total"] - sent[barrage.OVERSIZED]
    assert wait_until(lambda: sum(health.dropped.values()) >= expected)
    assert sum(health.dropped.values()) == expected
    assert set(health.dropped) == set(listener.Fault)
    assert ask_as_vllm_decode(port, 0) == PAYLOADS[0]
    assert barrage.handshake_ok(HOST, port, "v021")
    assert thread.is_alive() and health.healthy and health.restarts == 0
    warnings = [record for record in records if record.levelno >= logging.WARNING]
    assert len(warnings) == 1, [record.getMessage() for record in warnings]
    assert "from 127.0.0.1 " in warnings[0].getMessage()
    assert len(warnings[0].getMessage()) < 400


def test_upstreams_scheduler_starts_our_listener(records):
    """``set_xfer_handshake_metadata`` (upstream's) starts the override; a bad
    query does not end it, and ``shutdown`` (upstream's) stops it."""
    scheduler = object.__new__(NixlHMAConnectorScheduler)
    scheduler._nixl_handshake_listener_t = None
    scheduler._stop_event = threading.Event()
    scheduler.side_channel_port = free_port()
    metadata = {rank: NixlHandshakePayload(f"hash-{rank}", b"agent") for rank in range(2)}
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
        finally:
            context.destroy(linger=0)
        assert msgspec.msgpack.decode(answer, type=NixlHandshakePayload) == metadata[1]
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
        scheduler._nixl_handshake_listener_t = None
        scheduler._stop_event = threading.Event()
        scheduler.side_channel_port = taken.getsockname()[1]
        with pytest.raises(listener.ListenerFailedError, match="Address already in use"):
            scheduler.set_xfer_handshake_metadata({0: NixlHandshakePayload("hash", b"agent")})
        scheduler.shutdown()
    assert [r.levelno for r in records].count(logging.ERROR) == 1


def test_the_upstream_names_the_override_relies_on_are_there():
    upstream_contract.require(
        NixlConnectorScheduler,
        upstream_contract.installed().listener_overrides,
        owner_name="NixlConnectorScheduler",
        release="0.21.0",
    )
    listener.require_upstream_listener(
        NixlConnectorScheduler,
        glue.LISTENER_PARAMETERS,
        owner_name="NixlConnectorScheduler",
        release="0.21.0",
    )
    assert glue.WIRE.get_meta_msg == listener.GET_META_MSG == GET_META_MSG


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_canary_upstreams_listener_dies_of_one_frame_without_a_delimiter():
    """The fault is real: one DEALER message of one frame ends vLLM 0.21.0's
    listener thread, and a real query then goes unanswered."""
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=NixlConnectorScheduler._nixl_handshake_listener,
        args=(dict(PAYLOADS), ready, stop, port),
        daemon=True,
    )
    thread.start()
    assert ready.wait(5)
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"tcp://{HOST}:{port}")
        dealer.send(msgspec.msgpack.encode((GET_META_MSG, 0)))
        thread.join(5)
    finally:
        context.destroy(linger=0)
        stop.set()
    assert not thread.is_alive()
    assert barrage.handshake_answer(HOST, port, "v021", timeout_s=0.5) is None
