"""Prefill's NIXL side-channel listener, made to survive hostile peers (issue #25).

vLLM's listener (0.21.0 and 0.33.0 alike) answers each decode's query for a
rank's handshake payload on a ZMQ ROUTER, with nothing caught: one malformed
query ends its thread, and no decode can handshake with that prefill again.
``run_listener`` instead drops a bad query unanswered and logs it (at most
once per peer address per ``PeerLogLimiter.interval_s``), lets ZMQ drop a
peer that sends a frame over ``MAX_FRAME_BYTES``, restarts after an
unexpected error (``RestartPolicy``), and after too many restarts gives up
and marks its ``ListenerHealth`` failed, which the scheduler glue reports.

No vLLM: pyzmq, msgspec and the standard library. The glue
(``v021/listener.py``, ``v033/listener.py``) passes each release's ``Wire``.
"""

from __future__ import annotations

import enum
import inspect
import logging
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from vllm_nixl_hma.core.errors import UpstreamDriftError

__all__ = [
    "GET_META_MSG",
    "MAX_FRAME_BYTES",
    "MAX_QUERY_BYTES",
    "BadQuery",
    "Fault",
    "ListenerFailedError",
    "ListenerHealth",
    "PeerLogLimiter",
    "RestartPolicy",
    "Wire",
    "answer",
    "health_of",
    "parse_query",
    "preview",
    "require_upstream_listener",
    "run_listener",
    "serve",
    "supervise",
    "wire_v021",
    "wire_v033",
]

logger = logging.getLogger(f"vllm.{__name__}")

#: vLLM's query message type (``nixl.metadata.GET_META_MSG``, both releases)
GET_META_MSG = b"get_meta_msg"
#: ZMQ drops a peer that sends a larger frame (``zmq.MAXMSGSIZE``)
MAX_FRAME_BYTES = 64 * 1024
#: a real query is a few dozen bytes; a larger one is dropped undecoded
MAX_QUERY_BYTES = 1024
#: frames of one message kept for classification; more are read and counted
MAX_KEPT_FRAMES = 8
#: bytes of a peer's frame shown in a log line
PREVIEW_BYTES = 64
#: how often the loop looks at its stop event while idle
POLL_S = 0.1
#: bounded queues per peer (ZMQ's defaults; vLLM sets them unbounded)
HWM_MESSAGES = 1000


class ListenerFailedError(RuntimeError):
    """The side-channel listener failed too often and gave up: no decode can
    handshake with this engine."""


class Fault(enum.Enum):
    """Why a query was dropped."""

    ENVELOPE = "envelope"  # not [identity, empty delimiter, query]
    TOO_LARGE = "too large"  # query over MAX_QUERY_BYTES
    MALFORMED = "malformed"  # not msgpack: random, truncated, nested too deep
    SHAPE = "wrong shape"  # msgpack, not (message type, rank...) of ints
    UNKNOWN_MESSAGE = "unknown message"  # a message type other than GET_META_MSG
    UNKNOWN_RANK = "unknown rank"  # a rank this engine has no payload for


@dataclass(frozen=True)
class BadQuery:
    """A dropped query: its fault and a short description (no large dumps)."""

    fault: Fault
    detail: str


@dataclass(frozen=True)
class Wire:
    """One release's side-channel format."""

    release: str
    get_meta_msg: bytes
    #: the rank fields after the message type, in order
    rank_names: tuple[str, ...]
    #: the payloads' key for the parsed ranks
    key: Callable[[tuple[int, ...]], Hashable]
    #: frames the answer carries after the payload
    trailer: Callable[[], list[bytes]]


def _tp_rank_key(ranks: tuple[int, ...]) -> Hashable:
    return ranks[0]


def _no_trailer() -> list[bytes]:
    return []


def _perf_counter_trailer() -> list[bytes]:
    return [msgspec.msgpack.encode(time.perf_counter())]


def wire_v021(get_meta_msg: bytes = GET_META_MSG) -> Wire:
    """vLLM 0.21.0: ``(GET_META_MSG, tp_rank)``, answered with the payload."""
    return Wire("0.21.0", get_meta_msg, ("tp_rank",), _tp_rank_key, _no_trailer)


def wire_v033(get_meta_msg: bytes = GET_META_MSG) -> Wire:
    """vLLM 0.33.0: ``(GET_META_MSG, pp_rank, tp_rank)``, answered with the
    payload and this process's ``perf_counter`` (decode's clock offset)."""
    return Wire("0.33.0", get_meta_msg, ("pp_rank", "tp_rank"), tuple, _perf_counter_trailer)


def preview(data: bytes) -> str:
    """``repr`` of at most ``PREVIEW_BYTES`` of ``data``, with its length when cut."""
    if len(data) <= PREVIEW_BYTES:
        return repr(data)
    return f"{data[:PREVIEW_BYTES]!r}... ({len(data)} bytes)"


def _short(text: str) -> str:
    return text if len(text) <= PREVIEW_BYTES else text[:PREVIEW_BYTES] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_query(
    frames: Sequence[bytes], total_frames: int, wire: Wire
) -> tuple[int, ...] | BadQuery:
    """The ranks a query names, or why it is bad. ``frames``: the message's
    frames after the ROUTER's identity (at most ``MAX_KEPT_FRAMES``);
    ``total_frames``: how many there were."""
    expected = f"({', '.join(('message type',) + wire.rank_names)}) for vLLM {wire.release}"
    if total_frames != 2:
        return BadQuery(
            Fault.ENVELOPE,
            f"{total_frames} frames after the identity, expected 2 (empty delimiter, query)",
        )
    delimiter, body = frames[0], frames[1]
    if delimiter:
        return BadQuery(Fault.ENVELOPE, f"delimiter frame is {preview(delimiter)}, not empty")
    if len(body) > MAX_QUERY_BYTES:
        return BadQuery(Fault.TOO_LARGE, f"{len(body)} bytes, at most {MAX_QUERY_BYTES}")
    try:
        decoded = msgspec.msgpack.decode(body)
    except (msgspec.DecodeError, RecursionError) as error:
        return BadQuery(Fault.MALFORMED, f"{_short(str(error))}: {preview(body)}")
    if not isinstance(decoded, list):
        return BadQuery(Fault.SHAPE, f"a {type(decoded).__name__}, expected {expected}")
    if len(decoded) != 1 + len(wire.rank_names):
        return BadQuery(
            Fault.SHAPE,
            f"{len(decoded)} fields, expected {expected} (a peer on another vLLM release?)",
        )
    message, ranks = decoded[0], tuple(decoded[1:])
    if not all(_is_int(rank) for rank in ranks):
        return BadQuery(Fault.SHAPE, f"ranks {_short(repr(ranks))}, expected integers")
    if message != wire.get_meta_msg:
        shown = preview(message) if isinstance(message, bytes) else _short(repr(message))
        return BadQuery(Fault.UNKNOWN_MESSAGE, f"message type {shown}")
    return ranks


def answer(
    frames: Sequence[bytes], total_frames: int, wire: Wire, payloads: Mapping[Any, bytes]
) -> list[bytes] | BadQuery:
    """The frames answering a query (after identity and delimiter), or why
    it is dropped. ``payloads`` is read at each query (0.33 updates its own)."""
    ranks = parse_query(frames, total_frames, wire)
    if isinstance(ranks, BadQuery):
        return ranks
    payload = payloads.get(wire.key(ranks))
    if payload is None:
        named = ", ".join(
            f"{name}={rank}" for name, rank in zip(wire.rank_names, ranks, strict=True)
        )
        return BadQuery(Fault.UNKNOWN_RANK, _short(named))
    return [payload, *wire.trailer()]


class PeerLogLimiter:
    """At most one log line per peer per ``interval_s``; counts the rest.

    Remembers ``max_peers`` peers, forgetting (with their counts) those
    logged longest ago."""

    def __init__(
        self,
        interval_s: float = 30.0,
        max_peers: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.interval_s = interval_s
        self._max_peers = max_peers
        self._clock = clock
        self._logged_at: OrderedDict[str, float] = OrderedDict()
        self._suppressed: dict[str, int] = {}

    def admit(self, peer: str) -> int | None:
        """None: do not log. Else log now; the number is how many were
        suppressed for this peer since its last line."""
        now = self._clock()
        logged_at = self._logged_at.get(peer)
        if logged_at is not None and now - logged_at < self.interval_s:
            self._suppressed[peer] += 1
            return None
        suppressed = self._suppressed.get(peer, 0)
        self._logged_at[peer] = now
        self._logged_at.move_to_end(peer)
        self._suppressed[peer] = 0
        while len(self._logged_at) > self._max_peers:
            oldest, _ = self._logged_at.popitem(last=False)
            del self._suppressed[oldest]
        return suppressed


class RestartPolicy:
    """Restarts with doubling backoff; gives up at the failure after
    ``max_restarts`` within ``window_s``."""

    def __init__(
        self,
        max_restarts: int = 5,
        window_s: float = 60.0,
        first_backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._first_backoff_s = first_backoff_s
        self._max_backoff_s = max_backoff_s
        self._clock = clock
        self._failures_at: list[float] = []

    def after_failure(self) -> float | None:
        """Record a failure now: seconds to wait before restarting, or None to give up."""
        now = self._clock()
        self._failures_at = [at for at in self._failures_at if now - at < self.window_s]
        self._failures_at.append(now)
        if len(self._failures_at) > self.max_restarts:
            return None
        return min(self._first_backoff_s * 2 ** (len(self._failures_at) - 1), self._max_backoff_s)


class ListenerHealth:
    """What one listener did, and whether it gave up (written by its thread only)."""

    def __init__(self) -> None:
        self.answered = 0
        self.dropped: Counter[Fault] = Counter()
        self.restarts = 0
        self.failure: str | None = None

    @property
    def healthy(self) -> bool:
        return self.failure is None

    def give_up(self, reason: str) -> None:
        self.failure = reason

    def require(self) -> None:
        """Raise ``ListenerFailedError`` when the listener gave up."""
        if self.failure is not None:
            raise ListenerFailedError(
                "the NIXL side-channel listener gave up, so no decode can handshake "
                f"with this engine: {self.failure}"
            )


_health_lock = threading.Lock()
_health: weakref.WeakKeyDictionary[threading.Event, ListenerHealth] = weakref.WeakKeyDictionary()


def health_of(stop_event: threading.Event) -> ListenerHealth:
    """The health of the listener stopped by ``stop_event``: the one object
    upstream's static listener shares with its scheduler."""
    with _health_lock:
        return _health.setdefault(stop_event, ListenerHealth())


def _peer(identity: zmq.Frame) -> str:
    """The peer's address (stable across its connections), else its ROUTER identity."""
    try:
        address = identity.get("Peer-Address")
    except (zmq.ZMQError, TypeError, ValueError):
        address = None
    return str(address) if address else f"identity {identity.bytes.hex()}"


def _receive(sock: zmq.Socket) -> tuple[list[zmq.Frame], int]:
    """One message: its first ``MAX_KEPT_FRAMES`` frames and its frame count."""
    frame = sock.recv(zmq.NOBLOCK, copy=False)
    kept, total = [frame], 1
    while frame.more:
        frame = sock.recv(copy=False)  # a message arrives whole: never blocks
        total += 1
        if len(kept) < MAX_KEPT_FRAMES:
            kept.append(frame)
    return kept, total


def _warn(limiter: PeerLogLimiter, peer: str, bad: BadQuery) -> None:
    suppressed = limiter.admit(peer)
    if suppressed is None:
        return
    logger.warning(
        "NIXL side channel: dropped a query from %s (%s: %s); at most one such warning "
        "per peer per %.0f s, %d suppressed since the last",
        peer,
        bad.fault.value,
        bad.detail,
        limiter.interval_s,
        suppressed,
    )


def _open_router(context: zmq.Context, path: str) -> zmq.Socket:
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # set before bind: a listener copies the options its connections get
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.RCVHWM, HWM_MESSAGES)
    sock.setsockopt(zmq.SNDHWM, HWM_MESSAGES)
    if path.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(path)
    return sock


def serve(
    path: str,
    wire: Wire,
    payloads: Mapping[Any, bytes],
    ready_event: threading.Event,
    stop_event: threading.Event,
    health: ListenerHealth,
    limiter: PeerLogLimiter,
    poll_s: float = POLL_S,
) -> None:
    """Bind a ROUTER at ``path``, set ``ready_event`` and answer queries until
    ``stop_event``. A bad query is dropped and logged; anything else raised
    (bind, ZMQ, a payload lookup) ends this call."""
    context = zmq.Context()
    try:
        sock = _open_router(context, path)
        logger.debug("NIXL side channel: listening on %s", path)
        ready_event.set()
        poll_ms = max(1, round(poll_s * 1000))
        while not stop_event.is_set():
            if not sock.poll(poll_ms):
                continue
            try:
                frames, total_frames = _receive(sock)
            except zmq.Again:
                continue
            result = answer([frame.bytes for frame in frames[1:]], total_frames - 1, wire, payloads)
            if isinstance(result, BadQuery):
                health.dropped[result.fault] += 1
                _warn(limiter, _peer(frames[0]), result)
                continue
            try:
                # a ROUTER drops (never blocks on) a reply to a gone or full peer
                sock.send_multipart([frames[0].bytes, b"", *result], zmq.NOBLOCK)
            except zmq.Again:
                continue
            health.answered += 1
    finally:
        context.destroy(linger=0)


def supervise(
    serve_once: Callable[[], None],
    stop_event: threading.Event,
    ready_event: threading.Event,
    health: ListenerHealth,
    policy: RestartPolicy,
) -> None:
    """Run ``serve_once`` until ``stop_event``, restarting it after an error
    as ``policy`` allows; then give up: log, mark ``health`` failed. Sets
    ``ready_event`` on every exit (nobody waits forever for a bind)."""
    ended_cleanly = False
    try:
        while not stop_event.is_set():
            try:
                serve_once()
                if stop_event.is_set():
                    break
                raise RuntimeError("the listener returned before it was stopped")
            except Exception as error:
                backoff_s = policy.after_failure()
                if backoff_s is None:
                    reason = (
                        f"{policy.max_restarts + 1} failures within {policy.window_s:.0f} s, "
                        f"the last: {error!r}"
                    )
                    health.give_up(reason)
                    logger.error("NIXL side channel: listener gave up (%s)", reason, exc_info=True)
                    break
                health.restarts += 1
                logger.warning(
                    "NIXL side channel: listener failed; restart %d in %.1f s",
                    health.restarts,
                    backoff_s,
                    exc_info=True,
                )
                stop_event.wait(backoff_s)
        ended_cleanly = True
    finally:
        if not ended_cleanly and health.healthy:
            health.give_up("the listener thread ended on an exception it cannot catch")
            logger.error("NIXL side channel: %s", health.failure)
        ready_event.set()


def run_listener(
    path: str,
    wire: Wire,
    payloads: Mapping[Any, bytes],
    ready_event: threading.Event,
    stop_event: threading.Event,
    *,
    policy: RestartPolicy | None = None,
    limiter: PeerLogLimiter | None = None,
    poll_s: float = POLL_S,
) -> None:
    """The supervised listener, as the body of vLLM's listener thread; its
    health is ``health_of(stop_event)``."""
    health = health_of(stop_event)
    limiter = limiter if limiter is not None else PeerLogLimiter()
    supervise(
        lambda: serve(path, wire, payloads, ready_event, stop_event, health, limiter, poll_s),
        stop_event,
        ready_event,
        health,
        policy if policy is not None else RestartPolicy(),
    )


def require_upstream_listener(
    owner: type, parameters: tuple[str, ...], *, owner_name: str, release: str
) -> None:
    """Raise ``UpstreamDriftError`` unless ``owner._nixl_handshake_listener`` is
    a staticmethod taking ``parameters``: what the glue's override replaces."""
    name = "_nixl_handshake_listener"
    found = inspect.getattr_static(owner, name, None)
    if isinstance(found, staticmethod):
        if tuple(inspect.signature(found.__func__).parameters) == parameters:
            return
    from vllm_nixl_hma._compat import installed_vllm_version

    wanted = f"{name}({', '.join(parameters)}) (a staticmethod)"
    raise UpstreamDriftError(release, owner_name, [wanted], installed_vllm_version())
