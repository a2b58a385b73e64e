"""``vllm-nixl-hma proxy``: a small OpenAI-compatible P/D router.

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to a
prefill engine with ``max_tokens=1`` and ``kv_transfer_params`` asking for a
remote decode, then to a decode engine with the ``kv_transfer_params`` the
prefill engine returned, exactly as vLLM's P/D proxies route it. The decode
engine's answer is passed through as it comes, streamed or not; an error from
either engine is passed through with its status and body. Engines are picked
round robin over every (prefill, decode) pair, so that with several of each
every decode engine meets every prefill engine; each answer names the pair
in the ``x-pd-prefill`` and ``x-pd-decode`` headers (their URLs). Standard
library only (threads and ``http.client``), so that ``pip install`` gives
users a router with nothing else to install.

The router is a network server and trusts no client: a request body is read
only up to ``MAX_BODY_BYTES`` (413 past it, 411 without a Content-Length), a
client that stalls on its headers or body is dropped after
``client_timeout_s`` (408 once its headers came), a body that is not a JSON
object, or whose ``stream``, ``max_tokens`` or ``max_completion_tokens`` has
the wrong type, is answered 400 with a JSON error, and a client's own
``kv_transfer_params`` go to neither engine (prefill gets the router's,
decode prefill's). An engine that does not answer within ``timeout_s`` is a
504, one that is unreachable or answers no HTTP a 502, each naming it.

At scale the same job is done by production routers: vLLM's production
stack router, llm-d's inference scheduler and NVIDIA Dynamo route P/D
requests with load and cache awareness; this one is for a few engines.
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "CLIENT_TIMEOUT_S",
    "MAX_BODY_BYTES",
    "PDRouter",
    "prefill_request",
    "request_problem",
    "serve",
]

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
#: what the prefill engine is asked to do with the request's KV
PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
#: the largest request body the router reads, bytes (a prompt of 128k tokens
#: as JSON token ids is under 1 MiB)
MAX_BODY_BYTES = 8 * 1024 * 1024
#: seconds a client may take for each read of its request line, headers and body
CLIENT_TIMEOUT_S = 30.0
#: the request fields the router reads or rewrites: what each must be when present
_FIELD_TYPES = {
    "stream": ("a boolean", lambda v: isinstance(v, bool)),
    "stream_options": ("an object", lambda v: v is None or isinstance(v, dict)),
    "max_tokens": ("a whole number >= 1", lambda v: v is None or _whole_number(v)),
    "max_completion_tokens": ("a whole number >= 1", lambda v: v is None or _whole_number(v)),
}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}
#: the answer's headers that name the engines that served it
PREFILL_HEADER = "x-pd-prefill"
DECODE_HEADER = "x-pd-decode"


def _whole_number(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def request_problem(body: object) -> str | None:
    """Why a client's request body cannot be routed, or ``None``: it must be
    a JSON object whose fields the router reads have their types."""
    if not isinstance(body, dict):
        return f"request body must be a JSON object, got {type(body).__name__}"
    for field, (wanted, ok) in _FIELD_TYPES.items():
        if field in body and not ok(body[field]):
            return f"{field} must be {wanted}, got {json.dumps(body[field])[:80]}"
    return None


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill engine gets: one token, no streaming, remote decode."""
    request = dict(body)
    request["max_tokens"] = 1
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    request["stream"] = False
    request.pop("stream_options", None)
    request["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return request


class _Engine:
    def __init__(self, url: str):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"engine URL must be http://HOST:PORT, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.url = f"http://{self.host}:{self.port}"

    def connect(self, timeout_s: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)


class PDRouter:
    """Routing state: engines and their round-robin order."""

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        timeout_s: float = 600.0,
        client_timeout_s: float = CLIENT_TIMEOUT_S,
        max_body_bytes: int = MAX_BODY_BYTES,
    ):
        if not prefill or not decode:
            raise ValueError("at least one prefill and one decode engine are needed")
        if timeout_s <= 0 or client_timeout_s <= 0 or max_body_bytes < 1:
            raise ValueError(
                f"timeout_s={timeout_s}, client_timeout_s={client_timeout_s}, "
                f"max_body_bytes={max_body_bytes}: each must be positive"
            )
        self.prefill = [_Engine(url) for url in prefill]
        self.decode = [_Engine(url) for url in decode]
        #: seconds an engine may take to answer (each read of its answer)
        self.timeout_s = timeout_s
        self.client_timeout_s = client_timeout_s
        self.max_body_bytes = max_body_bytes
        self._lock = threading.Lock()
        # every pair in turn: cycling the two lists side by side would pair
        # prefill k with decode k alone whenever the counts are equal
        self._next_pair = itertools.cycle(itertools.product(self.prefill, self.decode))

    def pick(self) -> tuple[_Engine, _Engine]:
        with self._lock:
            return next(self._next_pair)


class _Handler(BaseHTTPRequestHandler):
    router: PDRouter
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # quiet; errors reach the client

    #: the engines serving the request being answered (headers to name them)
    _pair: tuple[tuple[str, str], ...] = ()

    def _pair_headers(self) -> None:
        for name, value in self._pair:
            self.send_header(name, value)

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self._pair_headers()
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._reply(status, {"error": {"message": message, "type": "proxy_error", "code": status}})

    def do_GET(self) -> None:  # noqa: N802
        self._pair = ()
        if self.path == "/health":
            self._reply(200, {"status": "ok"})
        elif self.path == "/v1/models":
            _, decode = self.router.pick()
            self._relay(decode, "GET", self.path, None)
        else:
            self._error(404, f"no route for GET {self.path}")

    def do_POST(self) -> None:  # noqa: N802
        self._pair = ()
        if self.path not in ROUTED_PATHS:
            self._error(404, f"no route for POST {self.path}")
            return
        body = self._read_body()
        if body is None:
            return  # answered (or the client is gone)
        problem = request_problem(body)
        if problem is not None:
            self._error(400, problem)
            return
        body.pop("kv_transfer_params", None)  # a client's own never reach an engine
        prefill, decode = self.router.pick()
        self._pair = ((PREFILL_HEADER, prefill.url), (DECODE_HEADER, decode.url))
        try:
            status, headers, data = self._call(prefill, self.path, prefill_request(body))
        except (OSError, http.client.HTTPException) as e:
            self._engine_failed("prefill", prefill, e)
            return
        if status != 200:
            self._send_whole(status, headers, data)
            return
        try:
            kv_transfer_params = json.loads(data).get("kv_transfer_params")
        except (ValueError, AttributeError, RecursionError):
            self._error(502, f"prefill engine {prefill.url} answered no JSON object")
            return
        if not kv_transfer_params:
            self._error(
                502,
                f"prefill engine {prefill.url} returned no kv_transfer_params: is it "
                "started with a kv_producer or kv_both --kv-transfer-config?",
            )
            return
        self._relay(decode, "POST", self.path, {**body, "kv_transfer_params": kv_transfer_params})

    def _engine_failed(self, role: str, engine: _Engine, error: Exception) -> None:
        """504 for an engine that answered nothing in time, 502 for one that
        could not be reached or answered something that is not HTTP."""
        if isinstance(error, TimeoutError):
            message = f"answered nothing within {self.router.timeout_s:g} s"
            self._error(504, f"{role} engine {engine.url} {message}")
        else:
            self._error(502, f"{role} engine {engine.url} unreachable: {error!r}")

    def _read_body(self) -> Any:
        """The request's JSON body, or ``None`` once the client was answered
        (or went away): a body is read only with a Content-Length within
        ``max_body_bytes``; a connection whose body is not read whole is closed."""
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            self._error(411, "send the request body with a Content-Length")
            return None
        length_text = self.headers.get("Content-Length")
        if length_text is None or not length_text.strip().isdigit():
            self.close_connection = True
            self._error(400, f"Content-Length must be a whole number, got {length_text!r}")
            return None
        length = int(length_text)
        if length > self.router.max_body_bytes:
            self.close_connection = True
            self._error(
                413, f"request body of {length} bytes; this router reads at most "
                f"{self.router.max_body_bytes}",
            )  # fmt: skip
            return None
        try:
            data = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            self._error(408, f"request body not received within {self.router.client_timeout_s:g} s")
            return None
        if len(data) < length:  # the client went away mid-body
            self.close_connection = True
            return None
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as e:  # ValueError: not JSON, not UTF-8
            self._error(400, f"request body is not JSON: {str(e)[:200]}")
            return None

    def _call(self, engine: _Engine, path: str, payload: dict[str, Any]):
        connection = engine.connect(self.router.timeout_s)
        try:
            connection.request(
                "POST", path, json.dumps(payload), {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()

    def _send_whole(self, status: int, headers, data: bytes) -> None:
        self.send_response(status)
        for name, value in headers:
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self._pair_headers()
        self.end_headers()
        self.wfile.write(data)

    def _relay(self, engine: _Engine, method: str, path: str, payload) -> None:
        """Pass the engine's answer through chunk by chunk (streams stay streams)."""
        connection = engine.connect(self.router.timeout_s)
        try:
            try:
                connection.request(
                    method,
                    path,
                    None if payload is None else json.dumps(payload),
                    {"Content-Type": "application/json"},
                )
                response = connection.getresponse()
            except (OSError, http.client.HTTPException) as e:
                self._engine_failed("decode", engine, e)
                return
            self.send_response(response.status)
            for name, value in response.getheaders():
                if name.lower() not in HOP_BY_HOP:
                    self.send_header(name, value)
            self.send_header("Transfer-Encoding", "chunked")
            self._pair_headers()
            self.end_headers()
            try:
                while chunk := response.read1(65536):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
            except (OSError, http.client.HTTPException):
                # the engine stalled or dropped mid-answer, or the client left:
                # the answer is cut, never ended as if it were whole
                self.close_connection = True
                return
            if response.length:
                # the engine closed before the Content-Length it announced:
                # ending the chunked answer cleanly would hand the client a
                # truncated body under the engine's 200; cut it instead
                self.close_connection = True
                return
            self.wfile.write(b"0\r\n\r\n")
        finally:
            connection.close()


def make_server(router: PDRouter, host: str, port: int) -> ThreadingHTTPServer:
    # ``timeout``: every read of a client's request (and write of its answer)
    handler = type("PDHandler", (_Handler,), {"router": router, "timeout": router.client_timeout_s})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def serve(
    prefill: Sequence[str],
    decode: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 8192,
    **limits: Any,
) -> None:
    """Run the router until interrupted (``limits``: ``PDRouter``'s timeouts and body size)."""
    server = make_server(PDRouter(prefill, decode, **limits), host, port)
    try:
        server.serve_forever()
    finally:
        server.server_close()
