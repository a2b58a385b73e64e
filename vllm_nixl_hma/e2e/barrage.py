"""Hostile traffic for a prefill's NIXL side channel, and one real query (issue #25).

``barrage`` throws malformed, truncated, oversized, random, wrongly shaped
and misaddressed queries at a side-channel listener from raw ZMQ DEALER and
REQ clients, and counts what it sent; ``handshake_ok`` then asks as a decode
of the given release does. The unit, integration and e2e tests share them.
No vLLM: pyzmq, msgspec and the standard library.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable

import msgspec
import zmq

from vllm_nixl_hma.core import side_channel
from vllm_nixl_hma.core.listener import GET_META_MSG, MAX_FRAME_BYTES, MAX_QUERY_BYTES

__all__ = [
    "ENVELOPE_KINDS",
    "KINDS",
    "OVERSIZED",
    "barrage",
    "bad_frames",
    "handshake_answer",
    "handshake_ok",
    "query",
    "side_channel_path",
    "well_formed",
]

#: kinds whose frames (after a DEALER's nothing) are not [empty, query]
ENVELOPE_KINDS = ("one_frame", "five_frames", "no_delimiter")
#: a frame over MAX_FRAME_BYTES: ZMQ drops the peer, the listener never sees it
OVERSIZED = "oversized"
#: every kind of bad message, in the order the barrage cycles through them
KINDS = (
    "malformed",  # not msgpack: an invalid opcode
    "truncated",  # a real query cut short
    "random",  # 1 to 200 random bytes
    "deep_nesting",  # arrays 1000 deep: msgspec's decoder raises RecursionError
    "empty",  # an empty query
    "big_query",  # valid msgpack over MAX_QUERY_BYTES, under MAX_FRAME_BYTES
    "wrong_shape",  # valid msgpack: a map, a string, strings for ranks, a bool rank
    "unknown_message",  # another message type, rank 0
    "unknown_rank",  # rank 9999 in either release's form
    *ENVELOPE_KINDS,
    OVERSIZED,
)
#: one message in this many goes from a new REQ socket left waiting for its answer
STRICT_REQ_EVERY = 100
#: one message in this many is oversized, from a new DEALER (its peer is dropped)
OVERSIZED_EVERY = 100
OVERSIZED_BYTES = 2 * MAX_FRAME_BYTES


def query(release: str, tp_rank: int = 0, pp_rank: int = 0) -> bytes:
    """A decode's query: ``(GET_META_MSG, tp_rank)`` on 0.21 (``v021``),
    ``(GET_META_MSG, pp_rank, tp_rank)`` on 0.33 (``v033``)."""
    if release == "v021":
        return msgspec.msgpack.encode((GET_META_MSG, tp_rank))
    if release == "v033":
        return msgspec.msgpack.encode((GET_META_MSG, pp_rank, tp_rank))
    raise ValueError(f"release is 'v021' or 'v033', got {release!r}")


def bad_frames(kind: str, rng: random.Random) -> list[bytes]:
    """A DEALER's frames for one bad message of ``kind`` (a REQ sends the
    last one after its own empty delimiter)."""
    real = query("v021")
    bodies: dict[str, Callable[[], bytes]] = {
        "malformed": lambda: b"\xc1" + rng.randbytes(8),
        "truncated": lambda: real[: rng.randrange(1, len(real))],
        "random": lambda: rng.randbytes(rng.randrange(1, 200)),
        "deep_nesting": lambda: b"\x91" * 1000 + b"\x00",
        "empty": lambda: b"",
        "big_query": lambda: msgspec.msgpack.encode("x" * (2 * MAX_QUERY_BYTES)),
        "wrong_shape": lambda: msgspec.msgpack.encode(
            rng.choice([{"tp": 0}, "get_meta_msg", [GET_META_MSG, "0"], [GET_META_MSG, True]])
        ),
        "unknown_message": lambda: msgspec.msgpack.encode(
            rng.choice([(b"get_meta_msg_v2", 0), (b"get_meta_msg_v2", 0, 0), ("get_meta_msg", 0)])
        ),
        "unknown_rank": lambda: msgspec.msgpack.encode(
            rng.choice([(GET_META_MSG, 9999), (GET_META_MSG, 0, 9999), (GET_META_MSG, -1)])
        ),
        OVERSIZED: lambda: rng.randbytes(OVERSIZED_BYTES),
    }
    if kind == "one_frame":
        return [real]
    if kind == "five_frames":
        return [b"", real, b"a", b"b", b"c"]
    if kind == "no_delimiter":
        return [b"x", real]
    return [b"", bodies[kind]()]


def side_channel_path(host: str, port: int) -> str:
    """``tcp://host:port``, the host in brackets when it is IPv6."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _client(context: zmq.Context, socket_type: int, path: str, relaxed: bool = False):
    sock = context.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)  # until barrage's end sets how long to flush
    if relaxed:
        sock.setsockopt(zmq.REQ_RELAXED, 1)  # send again without an answer
    if path.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(path)
    return sock


def _send(sock: zmq.Socket, frames: list[bytes], deadline: float) -> bool:
    while True:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            if time.monotonic() >= deadline:
                return False
            sock.poll(10, zmq.POLLOUT)


def barrage(
    host: str,
    port: int,
    frames: int = 1000,
    timeout_s: float = 10.0,
    *,
    seed: int = 0,
    dealers: int = 3,
    relaxed_reqs: int = 2,
) -> dict[str, int]:
    """Send ``frames`` bad messages to the side channel at ``host:port`` and
    return how many of each kind were sent (``KINDS``), ``total``, ``unsent``
    (past ``timeout_s``), and the clients used: ``dealer_clients`` (DEALERs,
    one new per oversized frame) and ``req_clients`` (REQs that send again
    without an answer, plus one new per ``STRICT_REQ_EVERY`` messages, each
    left waiting). Every socket is closed, waiting at most until
    ``timeout_s`` for what is queued to go out. No answer is read."""
    deadline = time.monotonic() + timeout_s
    rng = random.Random(seed)
    path = side_channel_path(host, port)
    sent: Counter[str] = Counter()
    unsent = 0
    context = zmq.Context()
    opened: list[zmq.Socket] = []  # every socket, closed by the context at the end
    try:
        dealer_socks = [_client(context, zmq.DEALER, path) for _ in range(dealers)]
        req_socks = [_client(context, zmq.REQ, path, relaxed=True) for _ in range(relaxed_reqs)]
        new_dealers = new_reqs = 0
        cycle = [kind for kind in KINDS if kind != OVERSIZED]
        for index in range(frames):
            if index % OVERSIZED_EVERY == OVERSIZED_EVERY - 1:
                kind = OVERSIZED
            else:
                kind = cycle[index % len(cycle)]
            message = bad_frames(kind, rng)
            if kind == OVERSIZED:
                sock, new_dealers = _client(context, zmq.DEALER, path), new_dealers + 1
                opened.append(sock)
            elif kind in ENVELOPE_KINDS:
                sock = dealer_socks[index % len(dealer_socks)]
            elif index % STRICT_REQ_EVERY == STRICT_REQ_EVERY // 2:
                sock, new_reqs = _client(context, zmq.REQ, path), new_reqs + 1
                opened.append(sock)
            else:
                clients = dealer_socks + req_socks
                sock = clients[index % len(clients)]
            if sock.socket_type == zmq.REQ:
                message = message[1:]  # a REQ adds the empty delimiter itself
            if _send(sock, message, deadline):
                sent[kind] += 1
            else:
                unsent += 1
    finally:
        # queued messages go out until the deadline (none when nobody listens)
        linger_ms = max(0, round((deadline - time.monotonic()) * 1000))
        context.destroy(linger=linger_ms)
        opened.clear()
    counts = {kind: sent[kind] for kind in KINDS}
    counts.update(
        total=sum(sent.values()),
        unsent=unsent,
        dealer_clients=dealers + new_dealers,
        req_clients=relaxed_reqs + new_reqs,
    )
    return counts


def handshake_answer(
    host: str,
    port: int,
    release: str | None = None,
    tp_rank: int = 0,
    pp_rank: int = 0,
    timeout_s: float = 5.0,
) -> list[bytes] | None:
    """The frames answering one decode query of ``release`` (``v021`` or
    ``v033``; the installed vLLM's when None), or None when unanswered
    within ``timeout_s``. Asks as vLLM's decode does (one REQ socket per
    attempt, ``side_channel.ask_frames``)."""
    if release is None:
        from vllm_nixl_hma._compat import adapter

        release = adapter()
    body = query(release, tp_rank=tp_rank, pp_rank=pp_rank)
    return side_channel.ask_frames(side_channel_path(host, port), body, total_s=timeout_s)


def well_formed(frames: list[bytes] | None, release: str) -> bool:
    """Whether ``frames`` is an answer of ``release``: a msgpack payload, and
    on 0.33 a second frame with prefill's ``perf_counter`` (a float)."""
    if not frames:
        return False
    try:
        msgspec.msgpack.decode(frames[0])
        if release == "v033":
            if len(frames) != 2:
                return False
            msgspec.msgpack.decode(frames[1], type=float)
        elif len(frames) != 1:
            return False
    except msgspec.DecodeError:
        return False
    return True


def handshake_ok(
    host: str,
    port: int,
    release: str | None = None,
    tp_rank: int = 0,
    pp_rank: int = 0,
    timeout_s: float = 5.0,
) -> bool:
    """Whether one decode query of ``release`` got a well-formed answer."""
    if release is None:
        from vllm_nixl_hma._compat import adapter

        release = adapter()
    frames = handshake_answer(host, port, release, tp_rank, pp_rank, timeout_s)
    return well_formed(frames, release)
