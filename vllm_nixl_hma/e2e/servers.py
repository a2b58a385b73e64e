"""vLLM OpenAI servers (and the P/D router) started for ``e2e``, each in its own
process group, logging to one file, stopped with everything they started.

Every server is started in a process group of its own (``process_group=0``),
in the caller's session; ``stop`` sends SIGTERM to the whole group (API
server, engine core, TP workers), waits, then SIGKILLs it. Not a session of
its own: the kernel schedules each session as a group (sched_autogroup), and
engines in groups of their own on one kernel starved each other for seconds
(docs/faults.md, "Slow and stalled reads"). ``ServerSet`` stops all of its
servers on exit from its ``with`` block, however the block ends (success,
exception, timeout, Ctrl-C).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "EngineSpec",
    "EngineStartError",
    "HTTPResult",
    "Server",
    "ServerSet",
    "last_error_line",
    "post_json",
    "post_raw",
    "post_stream",
]

STOP_GRACE_S = 20.0
MAX_MODEL_LEN = 2048
#: logical blocks per engine: room for 8 prompts of MAX_MODEL_LEN at 256-token blocks
NUM_BLOCKS = 64
_KERNEL_SPLIT = re.compile(
    r"logical block size \((\d+)\) does not match physical kernel block size \((\d+)\)"
)
_BLOCK_SIZE = re.compile(r'^vllm:cache_config_info\{(?:[^}]*,)?block_size="(\d+)"', re.MULTILINE)


@dataclass
class EngineSpec:
    """One vLLM OpenAI server."""

    name: str  # "reference", "prefill", "decode"
    model_dir: str
    port: int
    tp_size: int = 1
    connector: str | None = None  # None: no KV transfer config
    kv_role: str = "kv_both"
    side_channel_port: int | None = None
    kv_load_failure_policy: str = "fail"
    kernel_block_tokens: int | None = 16
    #: what vLLM's CPU fused-MoE layer is told about AMX (``cpu_moe.CHOICES``)
    cpu_amx: str = "host"
    extra_config: dict[str, Any] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)
    #: more ``vllm serve`` arguments (``--enable-prefix-caching``)
    extra_args: tuple[str, ...] = ()
    #: the address the engine serves HTTP on and advertises as its side-channel host
    host: str = "127.0.0.1"
    #: the network namespace (``e2e.netns``) the engine runs in; None: this one
    namespace: str | None = None
    #: data-parallel ranks (``--data-parallel-size``), each with its own engine core,
    #: KV cache and connector; the side channel of rank k listens on ``side_channel_port`` + k
    dp_size: int = 1
    #: with ``dp_size`` > 1: the port of the DP ranks' coordination (``--data-parallel-rpc-port``)
    dp_rpc_port: int | None = None

    def command(self) -> list[str]:
        netns_prefix = [] if self.namespace is None else ["ip", "netns", "exec", self.namespace]
        args = [
            *netns_prefix,
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--served-model-name",
            "model",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            "8",
            # a small cache: fewer NIXL descriptors to register and prepare per
            # handshake (the default 1 GiB gives half a million per rank)
            "--num-gpu-blocks-override",
            str(NUM_BLOCKS),
            "--enforce-eager",
            "--seed",
            "0",
            # e2e's chat prompts carry their template (the tiny models ship none)
            "--trust-request-chat-template",
            "--tensor-parallel-size",
            str(self.tp_size),
        ]
        args += list(self.extra_args)
        if self.tp_size > 1:
            args += ["--distributed-executor-backend", "mp"]
        if self.dp_size > 1:
            args += ["--data-parallel-size", str(self.dp_size)]
            if self.dp_rpc_port is not None:
                args += ["--data-parallel-rpc-port", str(self.dp_rpc_port)]
        if self.connector is not None:
            config = {
                "kv_connector": self.connector,
                "kv_role": self.kv_role,
                "kv_buffer_device": "cpu",
                "kv_load_failure_policy": self.kv_load_failure_policy,
            }
            if self.extra_config:
                config["kv_connector_extra_config"] = self.extra_config
            args += ["--kv-transfer-config", json.dumps(config)]
            if self.connector == "NixlConnector":
                # stock needs HMA asked for by hand (ours turns it on itself)
                args += ["--no-disable-hybrid-kv-cache-manager"]
        return args

    def environment(self) -> dict[str, str]:
        from vllm_nixl_hma.e2e import cpu_kernel_block, cpu_kv_core, cpu_mamba_copy, cpu_moe

        env = dict(os.environ)
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "VLLM_SSM_CONV_STATE_LAYOUT": "DS",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_NIXL_SIDE_CHANNEL_HOST": self.host,
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.ucx_environment())
        env.pop(cpu_kernel_block.ENV, None)
        # no worker pinned to one shared core (see cpu_kv_core)
        env[cpu_kv_core.ENV] = "1"
        # a MoE layer that can run in float32 on AMX hosts too (see cpu_moe)
        env[cpu_moe.ENV] = self.cpu_amx
        # Mamba state copies of prefix caching without Triton (see cpu_mamba_copy)
        env[cpu_mamba_copy.ENV] = "1"
        if self.kernel_block_tokens:
            env[cpu_kernel_block.ENV] = str(self.kernel_block_tokens)
        if self.side_channel_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        # Several engines share this machine: no OpenMP thread pinned to a core
        # (a TP 2 engine whose ranks were pinned to cores 0 and 1 hung in its
        # warm-up beside two other engines), one thread per worker, and threads
        # that sleep instead of spinning when they wait.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env.update(self.extra_env)
        return env

    def ucx_environment(self) -> dict[str, str]:
        """UCX as a host without RDMA talks to another host: TCP over the host's
        one interface. On one machine UCX would otherwise move the KV through
        shared memory between namespaces (they share a kernel), past the link."""
        if self.namespace is None:
            return {"UCX_NET_DEVICES": "lo"}
        return {"UCX_NET_DEVICES": "eth0", "UCX_TLS": "tcp"}


class Server:
    """A process group serving HTTP on ``host``:``port``, logging to ``log_path``."""

    def __init__(
        self,
        name: str,
        port: int,
        command: Sequence[str],
        env: dict[str, str],
        log_path: Path,
        host: str = "127.0.0.1",
    ):
        self.name = name
        self.port = port
        self.host = host
        self.log_path = log_path
        log = open(log_path, "a", buffering=1)  # noqa: SIM115 (the child holds it)
        log.write(f"===== {name}: {' '.join(command)}\n")
        log.flush()
        self.process = subprocess.Popen(
            list(command),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # a process group of its own, to stop it whole, but not a session
            # of its own: the kernel schedules each session as a group of its
            # own (sched_autogroup), and engines in groups of their own on one
            # kernel starved each other for seconds (docs/faults.md, #43)
            process_group=0,
        )
        log.close()  # the child has its own descriptor

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout_s: float, path: str = "/health") -> None:
        """Until ``path`` answers 200; raises ``EngineStartError`` (exited) or
        TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise EngineStartError(self)
            try:
                connection = http.client.HTTPConnection(self.host, self.port, timeout=5)
                connection.request("GET", path)
                if connection.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                connection.close()
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} was not ready within {timeout_s:.0f} s")

    def get(self, path: str, timeout_s: float = 10.0) -> tuple[int, str]:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            return response.status, response.read().decode(errors="replace")
        finally:
            connection.close()

    def block_tokens(self) -> tuple[int | None, int | None]:
        """(logical, kernel) block tokens of the engine's KV cache.

        The workers settle the logical block (a hybrid's is raised until an
        attention page holds a Mamba page) and log it when it differs from the
        kernel block; the front end's ``cache_config_info`` metric keeps the
        block size it started with, which is right only when nothing changed it.
        """
        found = _KERNEL_SPLIT.findall(self.log_path.read_text(errors="replace"))
        if found:
            logical, kernel = found[-1]
            return int(logical), int(kernel)
        try:
            status, text = self.get("/metrics")
        except OSError:
            return None, None
        metric = _BLOCK_SIZE.search(text) if status == 200 else None
        return (int(metric.group(1)),) * 2 if metric else (None, None)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def cpu_moe_paths(self) -> list[str]:
        """The fused-MoE paths this engine's processes logged (``cpu_moe``),
        one per process and layer kind, in order, without repeats."""
        from vllm_nixl_hma.e2e import cpu_moe

        seen: list[str] = []
        for path, _amx, _forced, _dtype in cpu_moe.paths_in_log(self.log_text()):
            if path not in seen:
                seen.append(path)
        return seen

    def kill(self) -> None:
        """SIGKILL the whole group at once (fault injection)."""
        self._signal(signal.SIGKILL)
        self.process.wait(timeout=STOP_GRACE_S)

    def stop(self) -> None:
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        # the group may outlive its leader (TP workers): make sure it is gone
        self._signal(signal.SIGKILL)
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        self._wait_group_gone(STOP_GRACE_S)

    def _wait_group_gone(self, timeout_s: float) -> None:
        """Until no process of the group is left. An engine's worker and engine
        core outlive its API server by seconds; the first P/D request sent
        while a stopped reference engine's processes were still exiting had
        its side-channel query unanswered for 5 s in about one run in three
        (dense, 1 -> 1), and never once they were gone."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


class EngineStartError(RuntimeError):
    """An engine's process exited before it served: its name, exit code,
    the last error line of its log, and the log's path, in one line."""

    def __init__(self, server: Server):
        self.engine = server.name
        self.exit_code = server.process.returncode
        self.last_error = last_error_line(server.log_text())
        self.log_path = server.log_path
        super().__init__(
            f"{self.engine} engine exited with code {self.exit_code} while starting: "
            f"{self.last_error or 'no error line in its log'} (log: {self.log_path})"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "exit_code": self.exit_code,
            "last_error": self.last_error,
            "log": str(self.log_path),
        }


#: the last line of a Python traceback, as vLLM's processes print it (a
#: worker's or engine core's lines start with its "(Name pid=N)" prefix)
_ERROR_LINE = re.compile(
    r"^(?:\([^)]*\)\s*)?((?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit)\b(?::.*)?)$"
)
#: vLLM's front end ends every engine-core start failure with this wrapper
_WRAPPER = "See root cause above"


def last_error_line(text: str) -> str | None:
    """The last exception line of a log that is not vLLM's "see root cause
    above" wrapper (else the wrapper's), or None."""
    found = [m.group(1).strip() for m in map(_ERROR_LINE.match, text.splitlines()) if m]
    causes = [line for line in found if _WRAPPER not in line]
    return (causes or found or [None])[-1]


class ServerSet:
    """Servers started for one run, each logging to ``log_dir/NAME.log``; all
    stopped on exit, Ctrl-C included."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.servers: list[Server] = []

    def start_engine(self, spec: EngineSpec) -> Server:
        return self.start(spec.name, spec.port, spec.command(), spec.environment(), spec.host)

    def start(
        self,
        name: str,
        port: int,
        command: Sequence[str],
        env: dict[str, str],
        host: str = "127.0.0.1",
    ) -> Server:
        server = Server(name, port, command, env, self.log_dir / f"{name}.log", host)
        self.servers.append(server)
        return server

    def stop(self, server: Server) -> None:
        server.stop()
        if server in self.servers:
            self.servers.remove(server)

    def __enter__(self) -> ServerSet:
        self._previous = {}
        for signum in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._previous[signum] = signal.signal(signum, _raise_interrupt)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc_info) -> bool:
        for server in reversed(self.servers):
            server.stop()
        self.servers.clear()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False


def _raise_interrupt(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt


@dataclass
class HTTPResult:
    status: int
    body: dict[str, Any] | None
    error: str | None = None
    #: the answer's headers, names in lower case (what ``post_raw`` got)
    headers: dict[str, str] = field(default_factory=dict)
    #: wall-clock seconds (``time.time()``) the request went out and its answer
    #: ended: what an engine log's lines are matched against
    sent_at: float = 0.0
    answered_at: float = 0.0

    def answered(self, status: int, body: dict[str, Any] | None, error: str | None) -> HTTPResult:
        """Another reading of the same answer: its headers and times kept."""
        return dataclasses.replace(self, status=status, body=body, error=error)


def post_json(url: str, path: str, payload: dict[str, Any], timeout_s: float) -> HTTPResult:
    """POST and parse; connection failures and timeouts come back as status 0."""
    answer = post_raw(url, path, payload, timeout_s)
    if answer.status == 0:
        return answer
    try:
        body = json.loads(answer.body["text"])
    except json.JSONDecodeError:
        return answer.answered(answer.status, None, answer.body["text"][:500])
    error = None
    if answer.status != 200:
        error = json.dumps(body.get("error", body) if isinstance(body, dict) else body)[:500]
    return answer.answered(answer.status, body if isinstance(body, dict) else None, error)


def post_stream(url: str, path: str, payload: dict[str, Any], timeout_s: float) -> HTTPResult:
    """POST a streaming request; the body is ``{"chunks": [...]}``, the JSON
    objects of the server-sent events up to ``[DONE]``."""
    answer = post_raw(url, path, payload, timeout_s)
    if answer.status != 200 or answer.error:
        return answer
    chunks = []
    for line in answer.body["text"].splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            chunks.append(json.loads(line.removeprefix("data: ")))
        except json.JSONDecodeError:
            return answer.answered(answer.status, None, f"not a JSON event: {line[:200]}")
    return answer.answered(answer.status, {"chunks": chunks}, None)


def post_raw(url: str, path: str, payload: dict[str, Any], timeout_s: float) -> HTTPResult:
    """POST; the body is ``{"text": ...}``, undecoded (status 0 on connection failure)."""
    host_port = url.removeprefix("http://")
    host, _, port = host_port.partition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    sent_at = time.time()
    try:
        connection.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as e:
        return HTTPResult(0, None, f"{type(e).__name__}: {e}", {}, sent_at, time.time())
    finally:
        connection.close()
    error = None if response.status == 200 else text[:500]
    headers = {name.lower(): value for name, value in response.getheaders()}
    return HTTPResult(response.status, {"text": text}, error, headers, sent_at, time.time())
