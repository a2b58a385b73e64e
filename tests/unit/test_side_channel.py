"""``side_channel.ask`` against a real ZMQ ROUTER on 127.0.0.1 that loses queries."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from vllm_nixl_hma.core import side_channel


@pytest.mark.parametrize("total_s", [0.3, 1.0, 5.0, 30.0])
def test_attempts_double_and_add_up_to_the_timeout(total_s):
    waits = side_channel.attempt_timeouts_s(total_s)
    assert sum(waits) == pytest.approx(total_s)
    assert waits[0] == min(side_channel.FIRST_ATTEMPT_S, total_s)
    for earlier, later in zip(waits, waits[1:-1], strict=False):
        assert later == 2 * earlier


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_a_timeout_that_is_not_positive_is_refused(bad):
    with pytest.raises(ValueError):
        side_channel.attempt_timeouts_s(bad)


class Listener:
    """A ROUTER like vLLM's side-channel listener that drops its first
    ``drop`` queries (a query stuck or lost) and answers every later one."""

    def __init__(self, drop: int):
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.sock.setsockopt(zmq.RCVTIMEO, 100)
        self.drop, self.seen, self.stop = drop, [], threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                identity, _, query = self.sock.recv_multipart()
            except zmq.Again:
                continue
            self.seen.append(query)
            if len(self.seen) > self.drop:
                self.sock.send_multipart([identity, b"", b"payload for " + query])

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close(linger=0)
        self.context.term()


@pytest.fixture
def listener(request):
    made = []

    def make(drop):
        made.append(Listener(drop))
        return made[-1]

    yield make
    for item in made:
        item.close()


def test_an_answered_query_needs_one_attempt(listener):
    server = listener(drop=0)
    retries = []
    answer = side_channel.ask(
        f"tcp://127.0.0.1:{server.port}", b"q", 5.0, lambda n, s: retries.append(n)
    )
    assert answer == b"payload for q" and retries == [] and server.seen == [b"q"]


def test_a_lost_query_is_asked_again_on_a_new_socket(listener):
    """Upstream's single query on one socket is never answered here."""
    server = listener(drop=2)
    retries = []
    started = time.monotonic()
    answer = side_channel.ask(
        f"tcp://127.0.0.1:{server.port}", b"q", 5.0, lambda n, s: retries.append((n, s))
    )
    assert answer == b"payload for q"
    assert retries == [(0, 0.5), (1, 1.0)] and len(server.seen) == 3
    assert time.monotonic() - started < 5.0


def test_nobody_answering_gives_none_after_the_timeout(listener):
    server = listener(drop=10**6)
    started = time.monotonic()
    assert side_channel.ask(f"tcp://127.0.0.1:{server.port}", b"q", 1.0) is None
    assert 0.9 <= time.monotonic() - started < 3.0
    assert len(server.seen) == len(side_channel.attempt_timeouts_s(1.0))
