"""Transfer records' JSON lines written off the step thread (#27).

A worker's step thread hands the records it finished in one step (each with
``to_json()``) to ``RecordLog.put``: one append to a deque, which wakes
nothing. A daemon thread of the process wakes every ``DRAIN_INTERVAL_S``,
turns what was queued into JSON and logs it, in the order it was put,
through the records logger (``vllm.vllm_nixl_hma.transfers``, at INFO) and
so through whatever handlers vLLM or the operator configured. Why a thread:
building the JSON and Python ``logging``'s record, format and write cost
tens of microseconds a record, which the step would otherwise pay for every
request it reads; why a timer and not a wake per put: waking a thread costs
the step about 15 us, as much as the rest of its records
(``benchmarks/records.py``).

What an operator sees: the lines come up to ``DRAIN_INTERVAL_S`` after the
step that made them; a record's own ``posted_at_s`` says when its read was
posted. ``flush`` and ``close`` wake the writer at once. At exit the writer
is given ``EXIT_FLUSH_S`` to write what is queued. A child forked from a
process whose writer runs starts its own writer (the queue is not shared).
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
import weakref
from typing import Any

__all__ = ["DRAIN_INTERVAL_S", "EXIT_FLUSH_S", "RecordLog"]

#: seconds the writer gets at interpreter exit to write what is queued
EXIT_FLUSH_S = 2.0
#: seconds between the writer's looks at the queue (``put`` does not wake it)
DRAIN_INTERVAL_S = 0.05


class _Flush:
    """A marker put in the queue: set once every record before it is written."""

    def __init__(self) -> None:
        self.written = threading.Event()


_STOP = object()


def _reset_in_child(log: weakref.ref) -> None:
    record_log = log()
    if record_log is not None:
        record_log._forked()


class RecordLog:
    """Records in, JSON lines out through ``records_logger`` on a writer thread."""

    def __init__(self, records_logger: logging.Logger | Any, message: str = "transfer record %s"):
        self._logger = records_logger
        self._message = message
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._exit_hook = False
        # a forked child starts afresh: without this, ``put`` would have to
        # ask the pid on every call (a system call a step)
        if hasattr(os, "register_at_fork"):
            this = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _reset_in_child(this))
        #: CPU seconds the writer thread spent writing records (all writers of this object)
        self.writer_cpu_s = 0.0
        self.written = 0

    def put(self, records: list[Any]) -> None:
        """Queue ``records`` (each has ``to_json()``) to be written, in order:
        one append however many records, and no wake (the writer looks every
        ``DRAIN_INTERVAL_S``)."""
        if not records:
            return
        if self._thread is None:
            self._start()
        self._queue.append(records)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every record put before this call is written; False if
        ``timeout_s`` ran out first."""
        if self._thread is None:
            return True  # nothing was put in this process
        marker = _Flush()
        self._queue.append(marker)
        self._wake.set()
        return marker.written.wait(timeout_s)

    def close(self, timeout_s: float = EXIT_FLUSH_S) -> bool:
        """Write what is queued (up to ``timeout_s``) and stop the writer; a
        later ``put`` starts a new one."""
        with self._lock:
            thread = self._thread
            if thread is None:
                return True
            self._queue.append(_STOP)
            self._wake.set()
            thread.join(timeout_s)
            self._thread = None
            return not thread.is_alive()

    def _forked(self) -> None:
        """In a forked child: the parent's writer, queue and lock are not
        this process's (the lock may have been held at the fork)."""
        self._lock = threading.Lock()
        self._queue = collections.deque()
        self._wake = threading.Event()
        self._thread = None  # (the parent's exit hook, inherited, closes this one)

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._write,
                args=(self._queue, self._wake),
                name="nixl-hma-records",
                daemon=True,
            )
            self._thread.start()
            if not self._exit_hook:
                atexit.register(self.close)
                self._exit_hook = True

    def _write(self, queued: collections.deque, wake: threading.Event) -> None:
        while True:
            wake.wait(DRAIN_INTERVAL_S)
            wake.clear()  # a set() after this is seen by the next wait
            while queued:
                batch = queued.popleft()
                if batch is _STOP:
                    return
                if isinstance(batch, _Flush):
                    batch.written.set()
                    continue
                self._write_batch(batch)

    def _write_batch(self, batch: list[Any]) -> None:
        started = time.thread_time()
        for record in batch:
            try:
                self._logger.info(self._message, record.to_json())
                self.written += 1
            except Exception:  # a record that cannot be written must not stop the rest
                logging.getLogger(__name__).exception(
                    "NixlHMAConnector: a transfer record was not written"
                )
        self.writer_cpu_s += time.thread_time() - started
