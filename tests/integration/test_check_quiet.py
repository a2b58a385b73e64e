"""``vllm-nixl-hma check`` is quiet by default: the table on stdout (#22),
progress lines on stderr, vLLM's and NIXL's lines in a log file whose path it
prints (#10)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_check_prints_table_on_stdout_progress_on_stderr_and_logs_the_rest_to_a_file():
    run = subprocess.run(
        [sys.executable, "-m", "vllm_nixl_hma", "check", "--layout", "dense"]
        + ["--prefill-tp", "1", "--decode-tp", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stderr.splitlines()
    assert len(lines) < 30, run.stderr  # a default run used to print about 850 lines
    assert not any(" INFO " in line or "NIXL INFO" in line for line in lines), run.stderr
    assert "2 passed, 0 failed" not in lines  # the table is the result: stdout
    table = run.stdout.splitlines()
    assert table[0].split()[:3] == ["scenario", "P_TP", "D_TP"], run.stdout
    assert table[-1] == "2 passed, 0 failed", run.stdout
    assert len(table) == 4, run.stdout  # header, two scenarios, summary: no log line
    [log_path] = re.findall(r"log to (\S+) ", run.stderr)
    log = Path(log_path).read_text()
    assert "NIXL" in log and "INFO" in log  # what was not printed is there
