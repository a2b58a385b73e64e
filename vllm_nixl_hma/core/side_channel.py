"""Asking a prefill engine's side channel for one rank's handshake payload.

No vLLM, no torch: pyzmq and the standard library only.

vLLM 0.21.0's decode sends one query on one ZMQ REQ socket and waits a fixed
5 s for the answer. A query that is lost (a connection dropped or reset, a
listener restarted) is never sent again: a REQ socket cannot send twice
without a reply. ZMQ's guide answers this with its "Lazy Pirate" pattern:
wait a short while, then close the socket and ask again on a new one, until a
deadline. Asking twice is harmless: the listener answers every query from the
same encoded payloads, and the answer to an abandoned socket is dropped. (The
first-handshake stalls seen through real engines on one host were not of this
kind: every attempt went unanswered; README's Known limits.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["FIRST_ATTEMPT_S", "ask", "ask_frames", "attempt_timeouts_s", "req_socket"]

#: how long the first attempt waits; each next one waits twice as long
FIRST_ATTEMPT_S = 0.5


def attempt_timeouts_s(total_s: float, first_s: float = FIRST_ATTEMPT_S) -> list[float]:
    """Waits per attempt: doubling from ``first_s``, the last one cut so that
    they add up to ``total_s``."""
    if not total_s > 0 or not first_s > 0:
        raise ValueError(f"timeouts must be positive, got total {total_s}, first {first_s}")
    waits: list[float] = []
    left, wait = total_s, first_s
    while left > 1e-9:
        waits.append(min(wait, left))
        left -= waits[-1]
        wait *= 2
    return waits


@contextlib.contextmanager
def req_socket(path: str) -> Iterator[Any]:
    """A ZMQ REQ socket connected to ``path`` on a context of its own, closed
    (nothing lingers) on exit."""
    import zmq

    context = zmq.Context()
    try:
        sock = context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        if path.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(path)
        yield sock
    finally:
        context.destroy(linger=0)


def _ask(path, query, total_s, on_retry, open_socket, receive):
    import zmq

    waits = attempt_timeouts_s(total_s)
    for attempt, wait_s in enumerate(waits):
        with open_socket(path) as sock:
            sock.setsockopt(zmq.RCVTIMEO, max(1, round(wait_s * 1000)))
            sock.send(query)
            try:
                return receive(sock)
            except zmq.Again:
                if on_retry is not None and attempt + 1 < len(waits):
                    on_retry(attempt, wait_s)
    return None


def ask(
    path: str,
    query: bytes,
    total_s: float,
    on_retry: Callable[[int, float], None] | None = None,
    open_socket: Callable[[str], AbstractContextManager[Any]] = req_socket,
) -> bytes | None:
    """The answer to ``query`` from the ZMQ REP/ROUTER at ``path``
    (``tcp://host:port``, brackets around an IPv6 host), or None when no
    attempt was answered within ``total_s`` seconds in all: its first frame,
    read with ``recv()`` as vLLM 0.21.0's worker reads it (vLLM's own tests
    stand a mock with ``recv`` in for the socket). ``on_retry(n, waited_s)``
    is called after attempt ``n`` went unanswered and another follows. Each
    attempt gets a new socket from ``open_socket(path)``, a context manager
    yielding a connected REQ socket (the decode worker passes vLLM's own
    ``zmq_ctx``, so that whatever vLLM's sockets do, ours do)."""
    return _ask(path, query, total_s, on_retry, open_socket, lambda sock: sock.recv())


def ask_frames(
    path: str,
    query: bytes,
    total_s: float,
    on_retry: Callable[[int, float], None] | None = None,
    open_socket: Callable[[str], AbstractContextManager[Any]] = req_socket,
) -> list[bytes] | None:
    """As ``ask``, with every frame of the answer: vLLM 0.33.0's listener adds
    a second to the payload, its ``perf_counter`` (for a clock offset)."""
    return _ask(path, query, total_s, on_retry, open_socket, lambda sock: sock.recv_multipart())
