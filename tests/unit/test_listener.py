"""``core.listener``: classifying bad queries, rate-limited warnings, the
restart policy and its supervisor, and the listener on real ZMQ sockets
(no vLLM: both releases' wires)."""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import pytest

from vllm_nixl_hma.core import listener
from vllm_nixl_hma.core.errors import UpstreamDriftError
from vllm_nixl_hma.core.listener import BadQuery, Fault
from vllm_nixl_hma.e2e import barrage

V021, V033 = listener.wire_v021(), listener.wire_v033()
PAYLOADS = {
    V021: {0: b"\x81\xa1r\x00", 1: b"\x81\xa1r\x01"},
    V033: {(0, 0): b"\x81\xa1r\x00", (0, 1): b"\x81\xa1r\x01"},
}
TP_RANK_1 = {V021: 1, V033: (0, 1)}


def body(*fields) -> list[bytes]:
    return [b"", msgspec.msgpack.encode(fields)]


def fault_of(frames: list[bytes], wire=V021, total: int | None = None) -> Fault | None:
    result = listener.answer(frames, len(frames) if total is None else total, wire, PAYLOADS[wire])
    return result.fault if isinstance(result, BadQuery) else None


GET = listener.GET_META_MSG
CASES_V021 = [
    ("one frame", [msgspec.msgpack.encode((GET, 0))], Fault.ENVELOPE),
    ("five frames", [b"", msgspec.msgpack.encode((GET, 0)), b"a", b"b", b"c"], Fault.ENVELOPE),
    ("no delimiter", [b"x", msgspec.msgpack.encode((GET, 0))], Fault.ENVELOPE),
    ("too large", [b"", b"\x00" * (listener.MAX_QUERY_BYTES + 1)], Fault.TOO_LARGE),
    ("invalid opcode", [b"", b"\xc1"], Fault.MALFORMED),
    ("truncated", [b"", msgspec.msgpack.encode((GET, 0))[:-1]], Fault.MALFORMED),
    ("empty", [b"", b""], Fault.MALFORMED),
    ("trailing bytes", [b"", msgspec.msgpack.encode((GET, 0)) + b"\x00"], Fault.MALFORMED),
    ("nested too deep", [b"", b"\x91" * 1000 + b"\x00"], Fault.MALFORMED),
    ("a map", [b"", msgspec.msgpack.encode({"tp": 0})], Fault.SHAPE),
    ("0.33's form", body(GET, 0, 0), Fault.SHAPE),
    ("no rank", body(GET), Fault.SHAPE),
    ("a string rank", body(GET, "0"), Fault.SHAPE),
    ("a bool rank", body(GET, True), Fault.SHAPE),
    ("another message", body(b"get_meta_msg_v2", 0), Fault.UNKNOWN_MESSAGE),
    ("a str message", body("get_meta_msg", 0), Fault.UNKNOWN_MESSAGE),
    ("unknown rank", body(GET, 9999), Fault.UNKNOWN_RANK),
    ("negative rank", body(GET, -1), Fault.UNKNOWN_RANK),
    ("a real query", body(GET, 1), None),
]


@pytest.mark.parametrize(
    "frames, fault", [case[1:] for case in CASES_V021], ids=[c[0] for c in CASES_V021]
)
def test_each_kind_of_bad_query_is_classified_on_0_21s_wire(frames, fault):
    assert fault_of(frames) == fault


@pytest.mark.parametrize(
    "frames, fault",
    [
        (body(GET, 0), Fault.SHAPE),  # a vLLM 0.21 query
        (body(GET, 0, 9999), Fault.UNKNOWN_RANK),
        (body(GET, 1, 0), Fault.UNKNOWN_RANK),
        (body(b"other", 0, 0), Fault.UNKNOWN_MESSAGE),
        (body(GET, 0, False), Fault.SHAPE),
        (body(GET, 0, 1), None),
    ],
)
def test_0_33s_wire_names_pp_and_tp_rank(frames, fault):
    assert fault_of(frames, V033) == fault


def test_a_message_with_more_frames_than_kept_is_judged_by_its_count():
    assert fault_of(body(GET, 0), total=200) == Fault.ENVELOPE


def test_answers_carry_the_payload_and_on_0_33_the_perf_counter():
    assert listener.answer(body(GET, 1), 2, V021, PAYLOADS[V021]) == [PAYLOADS[V021][1]]
    before = time.perf_counter()
    payload, stamp = listener.answer(body(GET, 0, 1), 2, V033, PAYLOADS[V033])
    assert payload == PAYLOADS[V033][(0, 1)]
    assert before <= msgspec.msgpack.decode(stamp, type=float) <= time.perf_counter()


def test_payloads_are_read_at_each_query():
    payloads = {}
    assert listener.answer(body(GET, 0, 0), 2, V033, payloads).fault == Fault.UNKNOWN_RANK
    payloads[(0, 0)] = b"late"
    assert listener.answer(body(GET, 0, 0), 2, V033, payloads)[0] == b"late"


def test_details_never_dump_a_large_frame():
    big = b"\xc1" + b"A" * 900
    bad = listener.answer([b"", big], 2, V021, PAYLOADS[V021])
    assert bad.fault == Fault.MALFORMED and len(bad.detail) < 250 and "(901 bytes)" in bad.detail
    assert len(listener.preview(b"x" * 10**6)) < 100
    assert listener.preview(b"short") == "b'short'"


class Clock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_one_warning_per_peer_per_interval_with_the_count_suppressed():
    clock = Clock()
    limiter = listener.PeerLogLimiter(interval_s=30, clock=clock)
    assert limiter.admit("10.0.0.1") == 0
    assert [limiter.admit("10.0.0.1") for _ in range(5)] == [None] * 5
    assert limiter.admit("10.0.0.2") == 0  # another peer is not held back
    clock.now_s += 29.9
    assert limiter.admit("10.0.0.1") is None
    clock.now_s += 0.1
    assert limiter.admit("10.0.0.1") == 6
    assert limiter.admit("10.0.0.1") is None


def test_the_limiter_remembers_a_bounded_number_of_peers():
    limiter = listener.PeerLogLimiter(interval_s=30, max_peers=3, clock=Clock())
    for peer in ("a", "b", "c", "d"):
        assert limiter.admit(peer) == 0
    assert len(limiter._logged_at) == 3
    assert limiter.admit("a") == 0  # forgotten: logged again
    assert limiter.admit("d") is None


def test_restarts_back_off_doubling_then_give_up_within_the_window():
    clock = Clock()
    policy = listener.RestartPolicy(max_restarts=5, window_s=60, first_backoff_s=0.1, clock=clock)
    waits = []
    for _ in range(5):
        waits.append(policy.after_failure())
        clock.now_s += 1
    assert waits == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6])
    assert policy.after_failure() is None


def test_failures_older_than_the_window_are_forgiven_and_backoff_is_capped():
    clock = Clock()
    policy = listener.RestartPolicy(
        max_restarts=5, window_s=60, first_backoff_s=1, max_backoff_s=3, clock=clock
    )
    assert [policy.after_failure() for _ in range(3)] == [1, 2, 3]
    clock.now_s += 61
    assert policy.after_failure() == 1


@pytest.fixture
def records():
    """What the listener logs (vLLM's loggers may not propagate to the root)."""
    caught: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = caught.append
    listener.logger.addHandler(handler)
    yield caught
    listener.logger.removeHandler(handler)


def run_supervised(serve_once, policy, stop=None):
    stop = stop or threading.Event()
    ready, health = threading.Event(), listener.ListenerHealth()
    thread = threading.Thread(
        target=listener.supervise, args=(serve_once, stop, ready, health, policy), daemon=True
    )
    thread.start()
    return thread, stop, ready, health


def test_the_supervisor_restarts_then_gives_up_and_marks_the_listener_failed(records):
    calls = []

    def always_fails():
        calls.append(1)
        raise OSError("address in use")

    policy = listener.RestartPolicy(max_restarts=3, first_backoff_s=0.01)
    thread, stop, ready, health = run_supervised(always_fails, policy)
    thread.join(5)
    assert not thread.is_alive() and len(calls) == 4
    assert ready.is_set()  # nobody waits forever for a bind that never came
    assert health.restarts == 3 and not health.healthy and "address in use" in health.failure
    with pytest.raises(listener.ListenerFailedError, match="gave up"):
        health.require()
    levels = [record.levelno for record in records]
    assert levels == [logging.WARNING] * 3 + [logging.ERROR]
    assert all(record.exc_info for record in records)
    stop.set()


def test_the_supervisor_restarts_after_a_failure_and_ends_on_stop():
    calls = []

    def fails_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        stop.set()

    stop = threading.Event()
    thread, _, ready, health = run_supervised(
        fails_once, listener.RestartPolicy(first_backoff_s=0.01), stop
    )
    thread.join(5)
    assert not thread.is_alive() and len(calls) == 2
    assert health.healthy and health.restarts == 1 and ready.is_set()


def test_a_stop_during_backoff_ends_the_supervisor_at_once():
    def fails():
        raise RuntimeError("boom")

    thread, stop, _, health = run_supervised(fails, listener.RestartPolicy(first_backoff_s=60))
    time.sleep(0.1)
    started = time.monotonic()
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - started < 1 and health.healthy


def test_a_listener_that_returns_unstopped_counts_as_a_failure():
    thread, stop, _, health = run_supervised(
        lambda: None, listener.RestartPolicy(max_restarts=1, first_backoff_s=0.01)
    )
    thread.join(5)
    assert not health.healthy and "returned before it was stopped" in health.failure


def test_an_uncatchable_exit_still_marks_the_listener_failed(records):
    def exits():
        raise SystemExit(3)

    stop, ready, health = threading.Event(), threading.Event(), listener.ListenerHealth()
    with pytest.raises(SystemExit):
        listener.supervise(exits, stop, ready, health, listener.RestartPolicy())
    assert not health.healthy and ready.is_set()
    assert records[-1].levelno == logging.ERROR


def test_health_is_found_by_the_schedulers_stop_event():
    stop = threading.Event()
    assert listener.health_of(stop) is listener.health_of(stop)
    assert listener.health_of(stop) is not listener.health_of(threading.Event())
    listener.health_of(stop).require()  # healthy: no error


class Upstream:
    @staticmethod
    def _nixl_handshake_listener(encoded_data, ready_event, stop_event, port):
        pass


class Renamed:
    @staticmethod
    def _nixl_handshake_listener(encoded_data, ready_event, stop_event, host, port):
        pass


class NotStatic:
    def _nixl_handshake_listener(self, encoded_data, ready_event, stop_event, port):
        pass


def test_an_upstream_listener_of_another_shape_stops_startup():
    parameters = ("encoded_data", "ready_event", "stop_event", "port")
    listener.require_upstream_listener(Upstream, parameters, owner_name="U", release="0.21.0")
    for drifted in (Renamed, NotStatic, object):
        with pytest.raises(UpstreamDriftError, match="_nixl_handshake_listener"):
            listener.require_upstream_listener(
                drifted, parameters, owner_name="U", release="0.21.0"
            )


# --- the listener on real sockets -------------------------------------------------------


class Live:
    """``run_listener`` on a thread, bound to 127.0.0.1 on a free port."""

    def __init__(self, wire, payloads, **kwargs):
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.ready, self.stop = threading.Event(), threading.Event()
        self.health = listener.health_of(self.stop)
        self.thread = threading.Thread(
            target=listener.run_listener,
            args=(f"tcp://127.0.0.1:{self.port}", wire, payloads, self.ready, self.stop),
            kwargs=kwargs,
            daemon=True,
        )
        self.thread.start()
        assert self.ready.wait(5)

    def close(self):
        self.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()


@pytest.fixture
def live():
    started = []

    def start(wire, payloads, **kwargs):
        started.append(Live(wire, payloads, **kwargs))
        return started[-1]

    yield start
    for each in started:
        each.close()


def wait_until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.parametrize("wire, release", [(V021, "v021"), (V033, "v033")])
def test_a_short_barrage_is_dropped_and_a_real_query_still_answered(live, records, wire, release):
    server = live(wire, PAYLOADS[wire])
    sent = barrage.barrage("127.0.0.1", server.port, frames=200, timeout_s=10)
    expected = sent["total"] - sent[barrage.OVERSIZED]
    assert sent["unsent"] == 0 and sent[barrage.OVERSIZED] == 2
    assert wait_until(lambda: sum(server.health.dropped.values()) == expected)
    frames = barrage.handshake_answer("127.0.0.1", server.port, release, tp_rank=1)
    assert frames[0] == PAYLOADS[wire][TP_RANK_1[wire]]
    assert barrage.well_formed(frames, release)
    # the listener counts a reply after sending it, so the client can read it first
    assert wait_until(lambda: server.health.answered >= 1)
    assert server.thread.is_alive() and server.health.healthy
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "127.0.0.1" in warnings[0].getMessage()


class FailsOnce(dict):
    """Payloads whose first lookup raises: an unexpected error in the loop."""

    def __init__(self, *args):
        super().__init__(*args)
        self.failed = False

    def get(self, key, default=None):
        if not self.failed:
            self.failed = True
            raise RuntimeError("lookup failed")
        return super().get(key, default)


def test_the_listener_restarts_after_an_unexpected_error(live, records):
    server = live(
        V021, FailsOnce(PAYLOADS[V021]), policy=listener.RestartPolicy(first_backoff_s=0.05)
    )
    assert barrage.handshake_ok("127.0.0.1", server.port, "v021", timeout_s=5)
    assert server.health.restarts == 1 and server.health.healthy and server.thread.is_alive()
    assert any("restart 1" in r.getMessage() for r in records if r.levelno == logging.WARNING)


def test_answers_of_each_release_are_told_apart():
    payload, stamp = b"\x81\xa1r\x00", msgspec.msgpack.encode(1.5)
    assert barrage.well_formed([payload], "v021") and not barrage.well_formed([payload], "v033")
    assert barrage.well_formed([payload, stamp], "v033")
    assert not barrage.well_formed([payload, stamp], "v021")
    assert not barrage.well_formed([b"\xc1"], "v021") and not barrage.well_formed(None, "v021")
    assert not barrage.well_formed([payload, b"\xa1x"], "v033")
    with pytest.raises(ValueError, match="v021"):
        barrage.query("0.21")


def test_the_listener_and_the_barrage_import_no_vllm():
    import subprocess
    import sys

    script = (
        "import sys, vllm_nixl_hma.core.listener, vllm_nixl_hma.e2e.barrage\n"
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"
