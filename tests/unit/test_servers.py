"""Process hygiene of ``e2e``'s servers: every server runs in its own process
group, and on success, failure, a start timeout, Ctrl-C or SIGTERM the whole
group is gone and nothing listens on its port. Stand-in engines: a leader
serving /health on 127.0.0.1 and a child that ignores SIGTERM, as a TP worker
can outlive its API server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from contextlib import nullcontext
from pathlib import Path

import pytest

from vllm_nixl_hma.e2e.servers import ServerSet
from vllm_nixl_hma.harness.coordinator import free_port

ENGINE = textwrap.dedent(
    """
    import http.server, os, signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    if sys.argv[2] == "never-ready":
        time.sleep(600)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
    """
)


def engine_command(port: int, mode: str = "ready") -> list[str]:
    return [sys.executable, "-c", ENGINE, str(port), mode]


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":  # pgrp, not a zombie
            members.append(int(entry.name))
    return members


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_until_gone(pgid: int, port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (group_members(pgid) or listening(port)):
        time.sleep(0.1)
    assert group_members(pgid) == [] and not listening(port)


def start_ready(servers: ServerSet, port: int):
    server = servers.start("engine", port, engine_command(port), dict(os.environ))
    server.wait_ready(60)
    deadline = time.monotonic() + 30
    while len(group_members(server.process.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(group_members(server.process.pid)) >= 2  # leader and its child
    return server


@pytest.mark.parametrize("outcome", ["success", "failure"])
def test_the_whole_group_is_stopped_when_the_run_ends(tmp_path, outcome):
    port = free_port()
    with pytest.raises(RuntimeError) if outcome == "failure" else nullcontext():
        with ServerSet(tmp_path) as servers:
            server = start_ready(servers, port)
            pgid = server.process.pid
            assert os.getpgid(pgid) == pgid and pgid != os.getpgid(0)  # its own group
            # but this run's session: the kernel schedules a session as a group of
            # its own, and engines in groups of their own starved each other (#43)
            assert os.getsid(pgid) == os.getsid(0)
            if outcome == "failure":
                raise RuntimeError("the run failed")
    assert group_members(pgid) == []  # gone when the run returns, not some time later
    wait_until_gone(pgid, port)


def test_a_server_that_never_gets_ready_times_out_and_is_stopped(tmp_path):
    port = free_port()
    with ServerSet(tmp_path) as servers:
        server = servers.start(
            "engine", port, engine_command(port, "never-ready"), dict(os.environ)
        )
        pgid = server.process.pid
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="not ready within 3 s"):
            server.wait_ready(3)
        assert time.monotonic() - started < 10
    wait_until_gone(pgid, port)


RUNNER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from vllm_nixl_hma.e2e.servers import ServerSet
    from tests.unit.test_servers import start_ready
    with ServerSet(Path(sys.argv[1])) as servers:
        server = start_ready(servers, int(sys.argv[2]))
        print(server.process.pid, flush=True)
        time.sleep(600)
    """
)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_to_the_runner_stops_every_server(tmp_path, signum):
    port = free_port()
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(tmp_path), str(port)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        pgid = int(runner.stdout.readline())
        assert listening(port)
        runner.send_signal(signum)
        runner.wait(timeout=60)
    finally:
        if runner.poll() is None:
            runner.kill()
    wait_until_gone(pgid, port)


#: the tail of a real reference.log whose engine died at start (AMX host, float32 MoE)
DYING = textwrap.dedent(
    """
    import sys
    print("(Worker pid=4752) ERROR 12-01 17:15:16 [multiproc_executor.py:962] "
          "AssertionError: Current vLLM config is not set.")
    print("(EngineCore pid=4742) RuntimeError: Worker failed with error 'Current vLLM "
          "config is not set.', please check the stack trace above for the root cause")
    print("(APIServer pid=4730)     raise RuntimeError(")
    print("(APIServer pid=4730) RuntimeError: Engine core initialization failed. See root "
          "cause above. Failed core proc(s): {'EngineCore': 1}")
    sys.exit(1)
    """
)


def test_an_engine_that_dies_while_starting_is_named_with_its_root_cause(tmp_path):
    from vllm_nixl_hma.e2e.servers import EngineStartError

    with ServerSet(tmp_path) as servers:
        server = servers.start(
            "reference", free_port(), [sys.executable, "-c", DYING], dict(os.environ)
        )
        with pytest.raises(EngineStartError) as raised:
            server.wait_ready(60)
    error = raised.value
    assert (error.engine, error.exit_code) == ("reference", 1)
    # the cause, not vLLM's "see root cause above" wrapper
    assert error.last_error.startswith("RuntimeError: Worker failed with error 'Current vLLM")
    assert str(error).count("\n") == 0 and str(tmp_path / "reference.log") in str(error)


def test_e2e_exits_5_with_one_line_when_the_reference_cannot_start(tmp_path, mocker, capfd):
    """Through the command: no traceback, exit code 5 (nothing could run); the
    one line is in the result table on stdout, progress on stderr."""
    from vllm_nixl_hma import cli
    from vllm_nixl_hma.e2e import servers

    model = tmp_path / "model"
    model.mkdir()
    mocker.patch.object(servers.EngineSpec, "command", lambda self: [sys.executable, "-c", DYING])
    code = cli.main(["e2e", "--model", str(model), "--start-timeout", "60"])
    out, err = capfd.readouterr()
    assert code == cli.ExitCode.NOTHING_RAN == 5
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and failed[0].startswith(
        "FAILED: reference engine exited with code 1 while starting: RuntimeError: Worker failed"
    ), out
    assert out.splitlines()[-1] == "0 passed, 1 failed", out
    assert "[e2e] failed: reference engine exited" in err
    assert "Traceback" not in out + err
    print("stdout still ours")  # fd 1 given back after the command
    assert capfd.readouterr().out == "stdout still ours\n"
