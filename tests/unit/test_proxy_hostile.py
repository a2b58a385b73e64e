"""``vllm-nixl-hma proxy`` is a network server: what a hostile or broken
client, or a hung or broken engine, gets from it (raw sockets and HTTP
clients on 127.0.0.1, stand-in engines); after each, it still routes a good
request."""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time

import pytest

from tests.unit.test_proxy import KV_PARAMS, Engine
from vllm_nixl_hma import proxy

#: the limits the router under test runs with: short, so stalls end fast
ENGINE_TIMEOUT_S = 1.0
CLIENT_TIMEOUT_S = 0.5
MAX_BODY_BYTES = 4096


class Silent:
    """An 'engine' that accepts connections and never answers (``garbage``:
    answers those bytes, which are not HTTP, and closes)."""

    def __init__(self, garbage: bytes | None = None):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.garbage = garbage
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            if self.garbage is None:
                self.held.append(connection)
            else:
                connection.recv(65536)
                connection.sendall(self.garbage)
                connection.close()

    def close(self):
        self.listener.close()
        for connection in self.held:
            connection.close()


@pytest.fixture
def router():
    started = []

    def start(prefill, decode):
        server = proxy.make_server(
            proxy.PDRouter(
                [prefill.url],
                [decode.url],
                timeout_s=ENGINE_TIMEOUT_S,
                client_timeout_s=CLIENT_TIMEOUT_S,
                max_body_bytes=MAX_BODY_BYTES,
            ),
            "127.0.0.1",
            0,
        )
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.extend([server, prefill, decode])
        return server.server_address[1]

    yield start
    for item in started:
        if isinstance(item, proxy.ThreadingHTTPServer):
            item.shutdown()
            item.server_close()
        else:
            item.close()


def good_engines():
    prefill = Engine(body={"choices": [{"text": "a"}], "kv_transfer_params": KV_PARAMS})
    decode = Engine(body={"choices": [{"text": "abc"}]})
    return prefill, decode


def post(port, payload, raw: bytes | None = None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    body = raw if raw is not None else json.dumps(payload)
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, json.loads(data)


def still_routes(port, decode) -> None:
    before = len(decode.received)
    status, answer = post(port, {"prompt": [1, 2], "max_tokens": 4})
    assert (status, answer) == (200, {"choices": [{"text": "abc"}]})
    assert len(decode.received) == before + 1


def raw_exchange(port, data: bytes, wait_s: float = 5.0) -> bytes:
    """Send ``data`` on a fresh socket, then read until the router closes it
    or ``wait_s`` passes (bounded)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(data)
        answer = b""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            answer += chunk
        return answer


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.") else 0


def test_a_clients_kv_transfer_params_reach_neither_engine(router):
    prefill, decode = good_engines()
    port = router(prefill, decode)
    forged = {"remote_engine_id": "elsewhere", "remote_host": "10.9.9.9", "remote_block_ids": [7]}
    status, _ = post(port, {"prompt": [1], "kv_transfer_params": forged})
    assert status == 200
    assert prefill.received[0]["kv_transfer_params"] == proxy.PREFILL_KV_TRANSFER_PARAMS
    assert decode.received[0]["kv_transfer_params"] == KV_PARAMS


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe\x00garbage", "not JSON"),
        (b"[" * 4000, "not JSON"),
        (b"[1, 2]", "JSON object, got list"),
        (b'"text"', "JSON object, got str"),
        (b'{"prompt": [1], "stream": "yes"}', "stream must be a boolean"),
        (b'{"prompt": [1], "max_tokens": "8"}', "max_tokens must be a whole number"),
        (b'{"prompt": [1], "max_tokens": 0}', "max_tokens must be a whole number"),
        (b'{"prompt": [1], "max_tokens": true}', "max_tokens must be a whole number"),
        (b'{"prompt": [1], "max_completion_tokens": 1.5}', "max_completion_tokens must be"),
        (b'{"prompt": [1], "stream_options": [1]}', "stream_options must be an object"),
    ],
)
def test_a_body_the_router_cannot_route_is_a_400_with_a_json_error(router, raw, says):
    prefill, decode = good_engines()
    port = router(prefill, decode)
    status, answer = post(port, None, raw=raw)
    assert status == 400 and says in answer["error"]["message"], answer
    assert prefill.received == [] and decode.received == []
    still_routes(port, decode)


def test_a_body_over_the_limit_is_a_413_without_being_read(router):
    prefill, decode = good_engines()
    port = router(prefill, decode)
    # announced, never sent: the router answers at once instead of waiting for it
    started = time.monotonic()
    answer = raw_exchange(
        port,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n",
    )
    assert status_of(answer) == 413 and b"at most 4096" in answer
    assert time.monotonic() - started < CLIENT_TIMEOUT_S
    status, _ = post(port, None, raw=b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}')
    assert status == 413
    assert prefill.received == []
    still_routes(port, decode)


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        (b"", 400),  # no Content-Length
        (b"Content-Length: -5\r\n", 400),
        (b"Content-Length: ten\r\n", 400),
        (b"Transfer-Encoding: chunked\r\n", 411),
    ],
)
def test_a_body_without_a_usable_length_is_refused(router, headers, status):
    prefill, decode = good_engines()
    port = router(prefill, decode)
    answer = raw_exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert status_of(answer) == status, answer[:200]
    assert b'"error"' in answer
    still_routes(port, decode)


def test_a_client_that_stalls_is_dropped_within_the_client_timeout(router):
    prefill, decode = good_engines()
    port = router(prefill, decode)
    # headers begun, never finished: the connection is closed, nothing routed
    started = time.monotonic()
    answer = raw_exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-", 5.0)
    assert answer == b"" and time.monotonic() - started < 4 * CLIENT_TIMEOUT_S
    # headers whole, body stalled after 10 of 100 bytes: 408
    answer = raw_exchange(
        port,
        b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt":',
        5.0,
    )
    assert status_of(answer) == 408 and b"not received within 0.5 s" in answer
    assert prefill.received == []
    still_routes(port, decode)


@pytest.mark.parametrize("hung", ["prefill", "decode"])
def test_an_engine_that_answers_nothing_is_a_504_naming_it(router, hung):
    prefill, decode = good_engines()
    silent = Silent()
    port = router(silent, decode) if hung == "prefill" else router(prefill, silent)
    started = time.monotonic()
    status, answer = post(port, {"prompt": [1]})
    assert status == 504 and silent.url in answer["error"]["message"]
    assert time.monotonic() - started < ENGINE_TIMEOUT_S + 2.0


@pytest.mark.parametrize("broken", ["prefill", "decode"])
def test_an_engine_that_answers_no_http_is_a_502_naming_it(router, broken):
    prefill, decode = good_engines()
    garbage = Silent(garbage=b"SSH-2.0-OpenSSH\r\n")
    port = router(garbage, decode) if broken == "prefill" else router(prefill, garbage)
    status, answer = post(port, {"prompt": [1]})
    assert status == 502 and garbage.url in answer["error"]["message"]


def test_a_barrage_of_random_and_truncated_requests_leaves_it_routing(router):
    """A bounded barrage (300 connections): random bytes, truncated request
    lines and headers, oversized header lines; then a good request."""
    prefill, decode = good_engines()
    port = router(prefill, decode)
    rng = random.Random(7)
    shapes = [
        lambda: bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 2000))),
        lambda: b"POST /v1/completions HTTP/1.1\r\n" + b"X-A: " + b"a" * 70_000 + b"\r\n\r\n",
        lambda: b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\n\r\n{" + b"\xff" * 4,
        lambda: b"GET " + b"/" * rng.randint(1, 70_000) + b" HTTP/1.1\r\n\r\n",
        lambda: b"POST /v1/completions HTTP/1.1\r\nHost",
    ]
    for index in range(300):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            try:
                sock.sendall(shapes[index % len(shapes)]())
                sock.shutdown(socket.SHUT_WR)
                sock.recv(4096)
            except OSError:
                pass  # the router may close first: that is an answer too
    assert prefill.received == []
    still_routes(port, decode)
