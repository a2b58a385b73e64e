"""``vllm_nixl_hma.proxy`` against two stand-in engines on 127.0.0.1 that record
what they are sent (the real engines are in the e2e test)."""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm_nixl_hma import proxy

KV_PARAMS = {"remote_engine_id": "prefill-engine", "remote_block_ids": [[3, 4]]}


class Engine:
    """Answers every POST with a fixed status and body (chunks for a stream);
    with ``cut_after``, closes the connection after that many bytes of it."""

    def __init__(self, status=200, body=None, chunks=None, cut_after=None):
        self.received: list[dict] = []
        #: each request's headers, names in lower case
        self.headers: list[dict[str, str]] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802 (a router's health checks)
                data = b"{}" if self.path == "/health" else b'{"error": "no route"}'
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):  # noqa: N802
                length = int(self.headers["Content-Length"])
                engine.received.append(json.loads(self.rfile.read(length)))
                engine.headers.append({k.lower(): v for k, v in self.headers.items()})
                if chunks is not None:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Content-Length", str(sum(map(len, chunks))))
                    self.end_headers()
                    for chunk in chunks:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    return
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[:cut_after])
                self.close_connection = cut_after is not None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def route():
    started = []

    def start(prefill: Engine, decode: Engine):
        router = proxy.make_server(proxy.PDRouter([prefill.url], [decode.url], 10), "127.0.0.1", 0)
        threading.Thread(target=router.serve_forever, daemon=True).start()
        started.extend([router, prefill, decode])
        return router.server_address[1]

    yield start
    for item in started:
        if isinstance(item, Engine):
            item.close()
        else:
            item.shutdown()
            item.server_close()


def post(port: int, path: str, payload) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, response.read()


def test_prefill_gets_one_token_and_decode_gets_prefills_kv_transfer_params(route):
    prefill = Engine(body={"choices": [{"text": "a"}], "kv_transfer_params": KV_PARAMS})
    decode = Engine(body={"choices": [{"text": "abc"}]})
    port = route(prefill, decode)
    request = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 8, "stream": False}
    status, data = post(port, "/v1/completions", request)
    assert status == 200 and json.loads(data) == {"choices": [{"text": "abc"}]}
    [sent_to_prefill] = prefill.received
    assert sent_to_prefill["max_tokens"] == 1 and sent_to_prefill["stream"] is False
    assert sent_to_prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert sent_to_prefill["prompt"] == [5, 6, 7]
    [sent_to_decode] = decode.received
    assert sent_to_decode == {**request, "kv_transfer_params": KV_PARAMS}


def test_a_stream_passes_through_chunk_by_chunk(route):
    chunks = [b'data: {"x": 1}\n\n', b'data: {"x": 2}\n\n', b"data: [DONE]\n\n"]
    prefill = Engine(body={"kv_transfer_params": KV_PARAMS})
    port = route(prefill, Engine(chunks=chunks))
    status, data = post(port, "/v1/chat/completions", {"messages": [], "stream": True})
    assert status == 200 and data == b"".join(chunks)
    assert prefill.received[0]["stream"] is False


@pytest.mark.parametrize("failing", ["prefill", "decode"])
def test_an_engine_error_passes_through_with_its_status(route, failing):
    error = {"error": {"message": "KV transfer failed", "code": 500}}
    ok = Engine(body={"kv_transfer_params": KV_PARAMS})
    bad = Engine(status=500, body=error)
    port = route(bad, ok) if failing == "prefill" else route(ok, bad)
    status, data = post(port, "/v1/completions", {"prompt": [1]})
    assert status == 500 and json.loads(data) == error


def test_a_decode_answer_cut_short_never_reaches_the_client_as_a_clean_200(route):
    """An engine that dies mid-answer leaves fewer bytes than its Content-Length:
    relayed with a clean end of the chunked answer, the client would read a
    truncated body under HTTP 200 (no tokens, no error); the router cuts the
    client's connection instead, so the client sees the answer break."""
    body = {"choices": [{"text": "abc", "token_ids": [1, 2, 3]}]}
    port = route(Engine(body={"kv_transfer_params": KV_PARAMS}), Engine(body=body, cut_after=10))
    with pytest.raises(http.client.IncompleteRead):
        post(port, "/v1/completions", {"prompt": [1]})


def test_a_prefill_without_kv_transfer_params_is_a_502_that_says_why(route):
    port = route(Engine(body={"choices": []}), Engine(body={}))
    status, data = post(port, "/v1/completions", {"prompt": [1]})
    assert status == 502 and b"kv_producer" in data


def test_an_unreachable_engine_is_a_502_naming_it(route):
    gone = Engine(body={})
    gone.close()
    port = route(gone, Engine(body={}))
    status, data = post(port, "/v1/completions", {"prompt": [1]})
    assert status == 502 and gone.url.encode() in data


def test_two_by_two_engines_every_decode_meets_every_prefill_and_answers_name_the_pair():
    """Round robin side by side would pair prefill k with decode k alone when the
    counts are equal: four requests must cover all four pairs, each answer
    naming the two engines that served it."""
    prefills = [Engine(body={"kv_transfer_params": {**KV_PARAMS, "n": k}}) for k in range(2)]
    decodes = [Engine(body={"choices": [{"text": "x"}]}) for _ in range(2)]
    router = proxy.make_server(
        proxy.PDRouter([e.url for e in prefills], [e.url for e in decodes], 10), "127.0.0.1", 0
    )
    threading.Thread(target=router.serve_forever, daemon=True).start()
    try:
        named = []
        for _ in range(4):
            connection = http.client.HTTPConnection("127.0.0.1", router.server_address[1], 10)
            connection.request("POST", "/v1/completions", json.dumps({"prompt": "p"}))
            response = connection.getresponse()
            response.read()
            assert response.status == 200
            named.append((response.getheader("x-pd-prefill"), response.getheader("x-pd-decode")))
            connection.close()
        assert sorted(named) == sorted((p.url, d.url) for p in prefills for d in decodes)
        # each decode engine got the params of the prefill engine the answer names
        urls = [e.url for e in prefills]
        for decode in decodes:
            sent = [r["kv_transfer_params"]["n"] for r in decode.received]
            assert sent == [urls.index(p) for p, d in named if d == decode.url]
    finally:
        router.shutdown()
        router.server_close()
        for engine in prefills + decodes:
            engine.close()
