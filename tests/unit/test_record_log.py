"""The records' writer thread (record_log.py, #27): every record put is
written, in order, off the caller's thread; a bad record loses only itself;
what is queued at exit is written; a forked child writes its own."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from vllm_nixl_hma.record_log import DRAIN_INTERVAL_S, RecordLog


class _Record:
    def __init__(self, n: int) -> None:
        self.n = n

    def to_json(self) -> str:
        return f'{{"n":{self.n}}}'


class _Broken:
    def to_json(self) -> str:
        raise ValueError("impossible numbers")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.threads: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.threads.add(record.threadName)


@pytest.fixture
def logger():
    log = logging.getLogger(f"test_record_log.{os.getpid()}.{threading.get_ident()}")
    log.propagate = False
    log.setLevel(logging.INFO)
    handler = _Lines()
    log.handlers[:] = [handler]
    yield log
    log.handlers[:] = []


def test_records_are_written_in_order_off_the_callers_thread(logger):
    writer = RecordLog(logger)
    writer.put([_Record(0), _Record(1)])
    writer.put([_Record(2)])
    assert writer.flush(10)
    handler = logger.handlers[0]
    assert handler.lines == [f'transfer record {{"n":{n}}}' for n in range(3)]
    assert handler.threads == {"nixl-hma-records"}
    assert writer.written == 3
    assert writer.close()


def test_a_record_that_cannot_be_written_loses_only_itself(logger, caplog):
    writer = RecordLog(logger)
    with caplog.at_level(logging.ERROR, logger="vllm_nixl_hma.record_log"):
        writer.put([_Record(0), _Broken(), _Record(2)])
        assert writer.flush(10)
    assert logger.handlers[0].lines == ['transfer record {"n":0}', 'transfer record {"n":2}']
    assert "impossible numbers" in caplog.text
    assert writer.close()


def test_nothing_put_starts_no_thread_and_close_restarts_on_the_next_put(logger):
    writer = RecordLog(logger)
    writer.put([])
    assert writer._thread is None and writer.flush(0.1) and writer.close()
    writer.put([_Record(0)])
    assert writer.close()  # writes what is queued, then stops
    assert logger.handlers[0].lines == ['transfer record {"n":0}']
    writer.put([_Record(1)])
    assert writer.flush(10) and writer.close()
    assert logger.handlers[0].lines[-1] == 'transfer record {"n":1}'


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


PRELUDE = """
    import logging, os, sys
    from vllm_nixl_hma.record_log import RecordLog

    class Record:
        def __init__(self, n):
            self.n = n
        def to_json(self):
            return str(self.n)

    log = logging.getLogger("records")
    log.propagate = False
    log.setLevel(logging.INFO)
    log.addHandler(logging.StreamHandler(sys.stdout))
    writer = RecordLog(log, "%s")
"""


def test_what_is_queued_at_exit_is_written():
    done = _run(PRELUDE + "    writer.put([Record(n) for n in range(500)])\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(n) for n in range(500)]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_writes_with_its_own_writer():
    done = _run(
        PRELUDE
        + """
    writer.put([Record("parent")])
    assert writer.flush(10)
    pid = os.fork()
    if pid == 0:
        writer.put([Record("child")])
        os._exit(0 if writer.flush(10) else 3)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
    """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["parent", "child"]


def test_a_put_wakes_nothing_and_the_writer_finds_it_on_its_own(logger):
    """The step thread pays one append: no wake (it cost the step about
    15 us a step); the writer finds the records within its interval."""
    writer = RecordLog(logger)
    writer.put([_Record(0)])
    assert not writer._wake.is_set()
    deadline = time.monotonic() + 20 * DRAIN_INTERVAL_S + 5
    while not logger.handlers[0].lines and time.monotonic() < deadline:
        time.sleep(0.01)
    assert logger.handlers[0].lines == ['transfer record {"n":0}']
    assert writer.close()
