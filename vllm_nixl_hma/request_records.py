"""Per-request transfer records of a worker (#27), on vLLM 0.21.0 and 0.33:
what decode read for each request (or why it did not) and how prefill freed
each request it served, as JSON lines and as counts in vLLM's connector
stats (``transfer_stats``).

``RequestRecords`` is a mixin first in the worker's bases. It only watches:
every decision (read, refuse, fail) stays where it was; the sites that
refuse or fail a request name their reason with ``_note_not_read``.

The JSON lines go to the logger ``vllm.vllm_nixl_hma.transfers`` at INFO,
only when ``kv_connector_extra_config`` has ``"transfer_records": true``
(the counts are always kept): one ``decode_read`` line per request and
decode TP rank, one ``prefill_served`` line per request and prefill TP rank.
The step thread only collects a step's records and queues them at once;
``record_log``'s thread makes the JSON lines and writes them.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from vllm.logger import init_logger

from vllm_nixl_hma.core import slow_reads
from vllm_nixl_hma.core.transfer_records import (
    DecodeRecord,
    Outcome,
    PrefillRecord,
    Reason,
    outcome_of,
    reason_of_handshake_error,
)
from vllm_nixl_hma.record_log import RecordLog

__all__ = [
    "RECORD_LOG",
    "RECORDS_LOGGER",
    "RequestRecords021",
    "RequestRecords033",
    "records_enabled",
]

RECORDS_LOGGER = "vllm.vllm_nixl_hma.transfers"
#: ``kv_connector_extra_config`` key that turns the JSON lines on
EXTRA_CONFIG_KEY = "transfer_records"

logger = init_logger(f"vllm.{__name__}")
records_logger = init_logger(RECORDS_LOGGER)
#: the process's writer of records' JSON lines (``record_log``)
RECORD_LOG = RecordLog(records_logger)


def records_enabled(extra_config: Any) -> bool:
    """``kv_connector_extra_config["transfer_records"]``: a bool, default False."""
    value = (extra_config or {}).get(EXTRA_CONFIG_KEY, False)
    if not isinstance(value, bool):
        raise ValueError(
            f"kv_connector_extra_config {EXTRA_CONFIG_KEY!r} must be true or false, got {value!r}"
        )
    return value


class _Reads:
    """What one request's reads on this rank came to so far: noted by the
    step thread as cheaply as it can (``_note_read``, ``_pop_done_transfers``);
    the writer thread turns it into a record's fields (``_FinishedRead.record``)."""

    __slots__ = (
        "engine_id", "posted_at_s", "posted", "post_s", "transfer_s", "bytes_read",
        "descriptors", "transfers", "slow", "ended_at_s",
    )  # fmt: skip

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.posted_at_s = time.time()
        #: per read posted: (remote TP rank, local kernel blocks in all groups,
        #: groups with any), counts only: holding on to the read's block id
        #: lists until the writer is done cost decode's step more than counting
        #: them (about 10 us a request at 8192 tokens, ``benchmarks/records.py``)
        self.posted: list[tuple[int, int, int]] = []
        self.post_s = 0.0
        self.transfer_s = 0.0
        self.bytes_read = 0
        self.descriptors = 0
        self.transfers = 0
        #: found in flight past ``slow_read_s`` (counted and logged then, once)
        self.slow = False
        #: wall clock when the step saw the request end (``_record_received``)
        self.ended_at_s: float | None = None


class _FinishedRead(NamedTuple):
    """What the step thread knows of a request it finished receiving; the
    records' writer thread makes the ``DecodeRecord`` (``to_json``)."""

    request_id: str
    outcome: Outcome
    reason: Reason
    #: the request's metadata (its ``remote`` names the prefill engine and host)
    meta: Any
    local_tp_rank: int
    reads: _Reads | None
    detail: str | None

    def record(self) -> DecodeRecord:
        remote = getattr(self.meta, "remote", None)
        engine_id = getattr(remote, "engine_id", None)
        if not engine_id and self.reads is not None:
            engine_id = self.reads.engine_id
        return DecodeRecord(
            request_id=self.request_id,
            outcome=self.outcome,
            reason=self.reason,
            remote_engine_id=engine_id,
            remote_host=getattr(remote, "host", None),
            local_tp_rank=self.local_tp_rank,
            detail=self.detail,
            **(self._read_fields() if self.reads is not None else {}),
        )

    def _read_fields(self) -> dict[str, Any]:
        """The record's fields from what was read (a refused request's reads
        posted nothing: its descriptors and bytes stay 0)."""
        reads = self.reads
        refused = self.outcome is Outcome.REFUSED
        return {
            "remote_tp_ranks": tuple(sorted({int(rank) for rank, _, _ in reads.posted})),
            "groups": max((groups for _, _, groups in reads.posted), default=0),
            "kernel_blocks": sum(kernel_blocks for _, kernel_blocks, _ in reads.posted),
            "descriptors": 0 if refused else reads.descriptors,
            "bytes_read": 0 if refused else reads.bytes_read,
            "posted_at_s": reads.posted_at_s,
            "post_s": reads.post_s if reads.transfers else None,
            "transfer_s": reads.transfer_s if reads.transfers else None,
            "read_s": (
                max(0.0, reads.ended_at_s - reads.posted_at_s)
                if reads.ended_at_s is not None
                else None
            ),
            "slow": reads.slow,
        }

    def to_json(self) -> str:
        return self.record().to_json()


class _FinishedReads(list):
    """A step's finished requests, each a plain tuple of ``_FinishedRead``'s
    fields (making a ``_FinishedRead`` is a Python call, per request, on the
    step thread); iterated, on the writer thread, it yields ``_FinishedRead``s."""

    __slots__ = ()

    def __iter__(self) -> Iterator[_FinishedRead]:
        return map(_FinishedRead._make, list.__iter__(self))


#: requests whose notifications are kept at most (the oldest go first)
_MAX_PREFILL_READERS = 65536


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:500] if text.strip() else ""


class RequestRecords:
    """Records of ``NixlHMAConnectorWorker`` (a mixin first in its bases)."""

    @functools.cached_property
    def _reads_by_request(self) -> dict[str, _Reads]:
        return {}

    @functools.cached_property
    def _not_read_reasons(self) -> dict[str, tuple[Reason, str]]:
        """{request id: why it is not read}, the first reason noted."""
        return {}

    @functools.cached_property
    def _handshake_failures(self) -> dict[str, tuple[Reason, str]]:
        """{remote engine id: why the last handshake with it failed}"""
        return {}

    @functools.cached_property
    def _prefill_readers(self) -> dict[str, list[str]]:
        """{request id: agent names that notified prefill of a read}"""
        return {}

    @functools.cached_property
    def _records_on(self) -> bool:
        config = getattr(self, "kv_transfer_config", None)
        return records_enabled(getattr(config, "kv_connector_extra_config", None))

    @functools.cached_property
    def _recompute_on_failure(self) -> bool:
        config = getattr(self, "kv_transfer_config", None)
        return getattr(config, "kv_load_failure_policy", "fail") == "recompute"

    def _forget_gone_requests(self) -> None:
        """Drop what is kept for requests this worker no longer holds (the
        scheduler freed them: vLLM reports nothing more about them)."""
        held = self._recving_metadata
        for kept in (self._reads_by_request, self._not_read_reasons):
            for request_id in [r for r in kept if r not in held]:
                del kept[request_id]
        readers = self._prefill_readers
        while len(readers) > _MAX_PREFILL_READERS:  # notifications for requests gone
            del readers[next(iter(readers))]

    def _note_not_read(self, request_id: str, reason: Reason, detail: object = "") -> None:
        """Name why ``request_id`` is not read; the first reason noted stays."""
        self._not_read_reasons.setdefault(request_id, (reason, _first_line(str(detail))))

    # ------------------------------------------------------------- decode side

    def _note_read(self, read_spec: Any, dst_engine_id: str, request_id: str) -> None:
        """Note what ``_read_blocks`` is about to read for ``request_id`` from
        one remote rank (both releases' ``ReadPath._read_blocks`` call this)."""
        reads = self._reads_by_request.get(request_id)
        if reads is None:
            reads = self._reads_by_request[request_id] = _Reads(str(dst_engine_id))
        lengths = list(map(len, read_spec.local_block_ids or ()))  # per group
        reads.posted.append((read_spec.remote_rank, sum(lengths), len(lengths) - lengths.count(0)))

    def _note_slow_reads(
        self, transfers: dict[str, list[int]], in_flight_s_of: dict[str, float]
    ) -> None:
        """Each read of ``transfers`` (request id -> NIXL handles still in
        flight) whose time in flight (``in_flight_s_of``) passed
        ``slow_read_s``, the first time: counted in the connector stats,
        marked in its record, and logged once with what the worker and NIXL
        know of it (``core.slow_reads``). Both releases' ``_abandon_overdue_reads``
        call this for the reads they keep."""
        bound_s = self._slow_read_s
        for request_id, in_flight_s in in_flight_s_of.items():
            reads = self._reads_by_request.get(request_id)
            if reads is None or reads.slow or not slow_reads.is_slow(in_flight_s, bound_s):
                continue
            reads.slow = True
            stats = getattr(self, "xfer_stats", None)
            if hasattr(stats, "record_slow_read"):
                stats.record_slow_read()
            states = []
            for handle in transfers.get(request_id, ()):
                try:
                    states.append(str(self.nixl_wrapper.check_xfer_state(handle)))
                except Exception as e:  # only words for the log: the step goes on
                    states.append(f"unknown ({type(e).__name__})")
            logger.warning(
                slow_reads.describe(
                    request_id,
                    in_flight_s,
                    bound_s,
                    engine_id=reads.engine_id,
                    remote_tp_ranks=sorted({int(rank) for rank, _, _ in reads.posted}),
                    kernel_blocks=sum(blocks for _, blocks, _ in reads.posted),
                    handle_states=states,
                )
            )

    @functools.cached_property
    def _slow_read_s(self) -> float | None:
        """``slow_read_s`` of ``kv_connector_extra_config`` (checked at start)."""
        config = getattr(self, "kv_transfer_config", None)
        return slow_reads.configured_slow_read_s(getattr(config, "kv_connector_extra_config", None))

    @contextlib.contextmanager
    def _noting_handshake_failure(self, engine_id: object) -> Iterator[None]:
        """Around a handshake with remote engine ``engine_id``: note why it
        failed (upstream handshakes once per engine; every request waiting
        on it fails with it, whatever address each names)."""
        try:
            yield
        except Exception as e:
            self._handshake_failures[str(engine_id)] = (
                reason_of_handshake_error(e),
                _first_line(str(e)),
            )
            raise
        self._handshake_failures.pop(str(engine_id), None)

    def _note_handshake_failures(self, request_ids, metas) -> None:
        """Name the reason of each failed request whose engine's handshake
        failed, before a later handshake with it succeeds."""
        for request_id in request_ids:
            remote = getattr(metas.get(request_id), "remote", None)
            failure = self._handshake_failures.get(str(getattr(remote, "engine_id", None)))
            if failure is not None:
                self._note_not_read(request_id, *failure)

    def _watch_telemetry(self) -> list[tuple[Any, Any]]:
        """Have this worker's NIXL agent note, in call order, each handle
        whose telemetry it returns (upstream's ``_pop_done_transfers`` asks
        once per finished read) with that telemetry. Once per agent, on first
        use (a worker built without its constructor is watched too)."""
        wrapper = self.nixl_wrapper
        noted = self.__dict__.get("_telemetry_noted")
        if noted is not None and self.__dict__.get("_telemetry_agent") is wrapper:
            return noted
        noted = self.__dict__["_telemetry_noted"] = []
        self.__dict__["_telemetry_agent"] = wrapper
        original = wrapper.get_xfer_telemetry

        def get_xfer_telemetry(handle: Any) -> Any:
            telemetry = original(handle)
            noted.append((handle, telemetry))
            return telemetry

        wrapper.get_xfer_telemetry = get_xfer_telemetry
        return noted

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> Any:
        """Upstream's ``_pop_done_transfers``, once for all requests as
        upstream calls it; each finished read's NIXL telemetry (what
        upstream records in ``xfer_stats``) is added to the request that
        posted its handle, known from ``transfers`` before the call."""
        if not transfers:
            return super()._pop_done_transfers(transfers)
        noted = self._watch_telemetry()
        noted.clear()
        owner = {id(handle): request_id for request_id, hs in transfers.items() for handle in hs}
        try:
            return super()._pop_done_transfers(transfers)
        finally:
            reads_by_request = self._reads_by_request
            for handle, telemetry in noted:  # no call per read: each one costs the step
                reads = reads_by_request.get(owner.get(id(handle)))  # type: ignore[arg-type]
                if reads is None:
                    continue
                try:  # µs and counts, as NIXL's ``nixlXferTelemetry`` has them
                    transfer_us = float(telemetry.xferDuration)
                    post_us = float(telemetry.postDuration)
                    nbytes = int(telemetry.totalBytes)
                    descriptors = int(telemetry.descCount)
                except (AttributeError, TypeError, ValueError):  # not NIXL's telemetry
                    continue
                reads.transfer_s += transfer_us / 1e6
                reads.post_s += post_us / 1e6
                reads.bytes_read += nbytes
                reads.descriptors += descriptors
                reads.transfers += 1
            noted.clear()

    def _record_received(self, request_id: str, meta: Any, failed: bool) -> None:
        """A request this rank finished receiving (or gave up): what is known
        of it is set aside; ``_write_records`` counts it and makes its record
        with the rest of the step's, at the end of the step."""
        reads = self._reads_by_request.pop(request_id, None)
        if reads is not None:
            reads.ended_at_s = time.time()
        self._received_of_step.append(
            (request_id, meta, failed, reads, self._not_read_reasons.pop(request_id, None))
        )

    @functools.cached_property
    def _received_of_step(self) -> list[tuple]:
        """(request id, metadata, failed, reads, reason noted) of each request
        finished since ``_write_records`` last ran."""
        return []

    def _count_received(self, received: list[tuple]) -> _FinishedReads | None:
        """The step's finished requests, in one pass: each one's outcome
        counted in the connector stats; with records on, returned to be
        queued (the writer thread makes the ``DecodeRecord`` and its line)."""
        recompute = self._recompute_on_failure
        finished = _FinishedReads() if self._records_on else None
        tp_rank = int(getattr(self, "tp_rank", 0))
        counts = []
        for request_id, meta, failed, reads, noted in received:
            if noted is None and failed:
                noted = (Reason.TRANSFER, "the transfer failed")
            nbytes, transfer_s = 0, None
            if noted is None:
                outcome, reason, detail = Outcome.READ, Reason.NONE, None
                if reads is not None:
                    nbytes = reads.bytes_read
                    transfer_s = reads.transfer_s if reads.transfers else None
            else:
                reason, detail = noted
                outcome = outcome_of(reason, recompute=recompute)
            counts.append((outcome, reason, nbytes, transfer_s))
            if finished is not None:
                finished.append((request_id, outcome, reason, meta, tp_rank, reads, detail))
        stats = getattr(self, "xfer_stats", None)
        if hasattr(stats, "count_requests"):
            stats.count_requests(counts)
        return finished

    def _emit(self, record: PrefillRecord) -> None:
        stats = getattr(self, "xfer_stats", None)
        if hasattr(stats, "record_prefill_request"):
            stats.record_prefill_request(record)
        if self._records_on:
            self._records_of_step.append(record)

    @functools.cached_property
    def _records_of_step(self) -> list[Any]:
        """Prefill records finished since ``_write_records`` last ran."""
        return []

    def _write_records(self) -> None:
        """At the end of the step's ``get_finished``: count the requests it
        finished (``_count_received``) and hand its records to the writer
        thread (``record_log``) at once."""
        received = self._received_of_step
        if received:
            self.__dict__["_received_of_step"] = []
            finished = self._count_received(received)
            if finished:
                RECORD_LOG.put(finished)
        if self._records_of_step:
            RECORD_LOG.put(self._records_of_step)
            self.__dict__["_records_of_step"] = []

    # ------------------------------------------------------------ prefill side

    def _watch_notifications(self) -> None:
        """Have this worker's NIXL agent hand each batch of notifications it
        returns to ``_notifs_seen`` too (the constructor calls this once;
        a worker built without it records no reader names)."""
        wrapper = self.nixl_wrapper
        original = wrapper.get_new_notifs
        seen = self._notifs_seen

        def get_new_notifs() -> dict[str, list[bytes]]:
            notifs = original()
            for agent_name, messages in notifs.items():
                seen.setdefault(agent_name, []).extend(messages)
            return notifs

        wrapper.get_new_notifs = get_new_notifs

    @functools.cached_property
    def _notifs_seen(self) -> dict[str, list[bytes]]:
        return {}

    def _get_new_notifs(self) -> set[str]:
        """Upstream's ``_get_new_notifs``, noting who notified (the agent
        names NIXL gives) for each request fully read."""
        self._notifs_seen.clear()
        notified = super()._get_new_notifs()
        for agent_name, messages in self._notifs_seen.items():
            for message in messages:
                request_id = bytes(message).decode("utf-8", "replace").rsplit(":", 1)[0]
                self._prefill_readers.setdefault(request_id, []).append(str(agent_name))
        self._notifs_seen.clear()
        return notified

    def _record_served(self, done_sending: set[str], notified: set[str]) -> None:
        for request_id in done_sending:
            readers = tuple(self._prefill_readers.pop(request_id, ()))
            freed_by = "notified" if request_id in notified else "lease"
            self._emit(
                PrefillRecord(
                    request_id,
                    readers=readers,
                    readers_expected=len(readers) if freed_by == "notified" else 0,
                    freed_by=freed_by,
                )
            )


class RequestRecords021(RequestRecords):
    """vLLM 0.21.0: ``get_finished`` reports a request done whether it was
    read or failed; a failed one has its blocks in ``_invalid_block_ids``."""

    def _get_new_notifs(self) -> set[str]:
        notified = super()._get_new_notifs()
        self.__dict__["_notified_this_step"] = set(notified)
        return notified

    def get_finished(self) -> tuple[set[str], set[str]]:
        metas = dict(self._recving_metadata)
        failed_now = set(tuple(self._failed_recv_reqs))
        self._note_handshake_failures(failed_now, metas)
        failed_before = failed_now | set(self._not_read_reasons)
        self.__dict__["_notified_this_step"] = set()
        done_sending, done_recving = super().get_finished()
        invalid = self._invalid_block_ids
        for request_id in done_recving:
            meta = metas.get(request_id)
            failed = request_id in failed_before or (
                meta is not None
                and any(b in invalid for group in meta.local_block_ids for b in group if b)
            )
            self._record_received(request_id, meta, failed)
        self._record_served(done_sending, self.__dict__.get("_notified_this_step", set()))
        self._write_records()
        self._forget_gone_requests()
        return done_sending, done_recving


class RequestRecords033(RequestRecords):
    """vLLM 0.33: ``get_transfer_results`` names the failed requests."""

    def _get_new_notifs(self) -> set[str]:
        notified = super()._get_new_notifs()
        self.__dict__["_notified_this_step"] = set(notified)
        return notified

    def get_transfer_results(self) -> Any:
        metas = dict(self._recving_metadata)
        self.__dict__["_notified_this_step"] = set()
        results = super().get_transfer_results()
        self._note_handshake_failures(results.failed_recving or (), metas)
        for request_id in results.finished_recving:
            failed = request_id in (results.failed_recving or ())
            self._record_received(request_id, metas.get(request_id), failed)
        self._record_served(
            set(results.finished_sending), self.__dict__.get("_notified_this_step", set())
        )
        self._write_records()
        self._forget_gone_requests()
        return results
