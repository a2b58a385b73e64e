"""The P/D router ``e2e`` sends its prompts through: ``vllm-nixl-hma proxy``
(this package's, in a thread) or vLLM's own ``vllm-router`` (a Rust binary
from the package index, ``pip install vllm-router``), and which engines served
each answer.

vLLM's router (0.1.17) in P/D mode: a prefill request with ``max_tokens`` 1,
``stream`` false and ``kv_transfer_params`` asking for a remote decode, then
the decode request with prefill's ``kv_transfer_params`` copied key for key
(our lease field included); one ``x-request-id`` for both, which vLLM makes
the answer's ``id``: ``cmpl-___prefill_addr_HOST:PORT___decode_addr_HOST:PORT_<hex>``.
It never retries a P/D request (a consumed transfer is never sent twice); an
engine error comes back with the engine's status, except a prefill 5xx or an
unreachable engine, which become a 500 whose text names the engine. Its
routing policies: ``round_robin`` for both sides moves the two counters in
step (prefill k with decode k alone when the counts are equal), so prefill is
picked round robin and decode at random.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import threading
from dataclasses import dataclass
from typing import Any

from vllm_nixl_hma.e2e.servers import HTTPResult, Server, ServerSet

__all__ = [
    "ROUTERS",
    "RouterUnavailable",
    "StartedRouter",
    "require_installed",
    "served_by",
    "start_router",
    "vllm_router_binary",
    "vllm_router_command",
]

ROUTERS = ("proxy", "vllm-router")

#: the answer ids vllm-router's request ids become (engines as HOST:PORT)
_VLLM_ROUTER_ID = re.compile(r"___prefill_addr_([^_\s]+)___decode_addr_([^_\s]+)_")
#: vllm-router's error text for an engine that failed or could not be reached
_VLLM_ROUTER_ERROR = re.compile(r"(Prefill|Decode)\b[^:]*?\b(?:server |to )(http://[^/\s:]+:\d+)")


class RouterUnavailable(RuntimeError):
    """The router asked for is not installed."""


@dataclass
class StartedRouter:
    """A router serving on ``url``; ``stop`` ends it."""

    url: str
    _stop: Any

    def stop(self) -> None:
        self._stop()


def vllm_router_binary() -> str | None:
    """``vllm-router`` beside this Python (its virtual environment), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("vllm-router")


def require_installed(kind: str) -> str | None:
    """The binary router ``kind`` runs (None: ours, in a thread); raises
    ``RouterUnavailable`` naming the install command when it is missing."""
    if kind not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {kind!r}")
    if kind == "proxy":
        return None
    binary = vllm_router_binary()
    if binary is None:
        raise RouterUnavailable(
            "vllm-router is not installed (pip install vllm-router, or "
            "pip install 'vllm-nixl-hma[router]')"
        )
    return binary


def vllm_router_command(
    binary: str,
    host: str,
    port: int,
    metrics_port: int,
    prefill_urls: list[str],
    decode_urls: list[str],
    request_timeout_s: float,
    namespace: str | None = None,
) -> list[str]:
    """vLLM's router in P/D mode with the NIXL connector over these engines.
    Its metrics listener defaults to one fixed port: each run names its own."""
    command = [] if namespace is None else ["ip", "netns", "exec", namespace]
    command += [binary, "--host", host, "--port", str(port)]
    command += ["--prometheus-host", host, "--prometheus-port", str(metrics_port)]
    command += ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
    for url in prefill_urls:
        command += ["--prefill", url]
    for url in decode_urls:
        command += ["--decode", url]
    command += ["--prefill-policy", "round_robin", "--decode-policy", "random"]
    # the engines are up before it starts: check them every second, not every 30
    command += ["--worker-startup-check-interval", "1"]
    command += ["--request-timeout-secs", str(max(1, int(request_timeout_s)))]
    command += ["--log-level", "error"]
    return command


def start_router(
    kind: str,
    prefill_urls: list[str],
    decode_urls: list[str],
    host: str,
    request_timeout_s: float,
    servers: ServerSet,
    namespace: str | None = None,
    start_timeout_s: float = 120.0,
) -> StartedRouter:
    """Start router ``kind`` over the engines, serving on ``host``; ready when it returns."""
    from vllm_nixl_hma import proxy
    from vllm_nixl_hma.harness.coordinator import free_port

    binary = require_installed(kind)
    if binary is None:
        server = proxy.make_server(
            proxy.PDRouter(prefill_urls, decode_urls, request_timeout_s), host, free_port()
        )
        threading.Thread(target=server.serve_forever, daemon=True).start()

        def stop_proxy() -> None:
            server.shutdown()
            server.server_close()

        return StartedRouter(f"http://{host}:{server.server_address[1]}", stop_proxy)
    port = free_port()
    command = vllm_router_command(
        binary,
        host,
        port,
        free_port(),
        prefill_urls,
        decode_urls,
        request_timeout_s,
        namespace,
    )
    started: Server = servers.start("router", port, command, dict(os.environ), host)
    # /readiness answers once each side has a healthy engine (/health is 200 earlier)
    started.wait_ready(start_timeout_s, path="/readiness")
    return StartedRouter(started.url, lambda: servers.stop(started))


def served_by(answer: HTTPResult) -> tuple[str | None, str | None]:
    """(prefill URL, decode URL) of the engines that served ``answer``, as far
    as it tells: our proxy's headers; vllm-router's request id in the answer's
    ``id`` (a stream's chunks carry it too); for an error, the engine its text
    names."""
    from vllm_nixl_hma import proxy

    prefill = answer.headers.get(proxy.PREFILL_HEADER)
    decode = answer.headers.get(proxy.DECODE_HEADER)
    if prefill or decode:
        return prefill, decode
    body = answer.body or {}
    for item in [body, *body.get("chunks", [])]:
        found = _VLLM_ROUTER_ID.search(str(item.get("id") or ""))
        if found:
            return f"http://{found.group(1)}", f"http://{found.group(2)}"
    text = answer.error or ""
    named = {side: url for side, url in _VLLM_ROUTER_ERROR.findall(text)}
    return named.get("Prefill"), named.get("Decode")
