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
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger

from vllm_nixl_hma.core.transfer_records import (
    DecodeRecord,
    Outcome,
    PrefillRecord,
    Reason,
    outcome_of,
    reason_of_handshake_error,
)

__all__ = ["RECORDS_LOGGER", "RequestRecords021", "RequestRecords033", "records_enabled"]

RECORDS_LOGGER = "vllm.vllm_nixl_hma.transfers"
#: ``kv_connector_extra_config`` key that turns the JSON lines on
EXTRA_CONFIG_KEY = "transfer_records"

logger = init_logger(f"vllm.{__name__}")
records_logger = init_logger(RECORDS_LOGGER)


def records_enabled(extra_config: Any) -> bool:
    """``kv_connector_extra_config["transfer_records"]``: a bool, default False."""
    value = (extra_config or {}).get(EXTRA_CONFIG_KEY, False)
    if not isinstance(value, bool):
        raise ValueError(
            f"kv_connector_extra_config {EXTRA_CONFIG_KEY!r} must be true or false, got {value!r}"
        )
    return value


@dataclass
class _Reads:
    """What one request's reads on this rank came to so far."""

    engine_id: str
    remote_ranks: set[int] = field(default_factory=set)
    groups: int = 0
    kernel_blocks: int = 0
    descriptors: int = 0
    bytes_read: int = 0
    posted_at_s: float | None = None
    post_s: float = 0.0
    transfer_s: float = 0.0
    transfers: int = 0


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
            reads.posted_at_s = time.time()
        reads.remote_ranks.add(int(read_spec.remote_rank))
        kinds = getattr(self, "_group_kinds", ())
        ratio = int(getattr(self, "_physical_blocks_per_logical_kv_block", 1))
        for index, ids in enumerate(read_spec.local_block_ids or ()):
            attention = index >= len(kinds) or kinds[index].is_attention
            reads.kernel_blocks += len(ids) * (ratio if attention else 1)
        groups_read = sum(1 for ids in read_spec.local_block_ids or () if len(ids))
        reads.groups = max(reads.groups, groups_read)

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

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> Any:
        """Upstream's ``_pop_done_transfers`` one request at a time, so that
        the NIXL telemetry it records for each finished read (vLLM's
        ``xfer_stats.record_transfer``) is known to be this request's."""
        stats = getattr(self, "xfer_stats", None)
        data = getattr(stats, "data", None)
        durations = data.get("transfer_duration") if isinstance(data, dict) else None
        if not isinstance(durations, list):  # not vLLM's NIXL stats: nothing to attribute
            return super()._pop_done_transfers(transfers)
        results: list[Any] = []
        for request_id in list(transfers):
            one = {request_id: transfers[request_id]}
            first = len(durations)
            results.append(super()._pop_done_transfers(one))
            if request_id in one:
                transfers[request_id] = one[request_id]
            else:
                del transfers[request_id]
            if len(durations) > first:
                self._add_telemetry(request_id, stats.data, first)
        if not results:
            return super()._pop_done_transfers(transfers)
        if isinstance(results[0], tuple):  # 0.33: (done, failed)
            return set().union(*(r[0] for r in results)), set().union(*(r[1] for r in results))
        return set().union(*results)

    def _add_telemetry(self, request_id: str, data: dict, first: int) -> None:
        reads = self._reads_by_request.get(request_id)
        if reads is None:
            return
        reads.transfer_s += float(sum(data["transfer_duration"][first:]))
        reads.post_s += float(sum(data["post_duration"][first:]))
        reads.bytes_read += int(sum(data["bytes_transferred"][first:]))
        reads.descriptors += int(sum(data["num_descriptors"][first:]))
        reads.transfers += len(data["transfer_duration"]) - first

    def _record_received(self, request_id: str, meta: Any, failed: bool) -> None:
        """The record of a request this rank finished receiving (or gave up)."""
        reads = self._reads_by_request.pop(request_id, None)
        noted = self._not_read_reasons.pop(request_id, None)
        remote = getattr(meta, "remote", None)
        host = getattr(remote, "host", None)
        if noted is None and failed:
            noted = (Reason.TRANSFER, "the transfer failed")
        if noted is None:
            outcome, reason, detail = Outcome.READ, Reason.NONE, None
        else:
            reason, detail = noted
            outcome = outcome_of(reason, recompute=self._recompute_on_failure)
        refused = outcome is Outcome.REFUSED or (outcome is Outcome.RECOMPUTED and reads is None)
        engine_id = getattr(remote, "engine_id", None) or (reads.engine_id if reads else None)
        record = DecodeRecord(
            request_id=request_id,
            outcome=outcome,
            reason=reason,
            remote_engine_id=engine_id,
            remote_host=host,
            local_tp_rank=int(getattr(self, "tp_rank", 0)),
            remote_tp_ranks=tuple(sorted(reads.remote_ranks)) if reads else (),
            groups=reads.groups if reads else 0,
            kernel_blocks=reads.kernel_blocks if reads else 0,
            descriptors=0 if refused or reads is None else reads.descriptors,
            bytes_read=0 if refused or reads is None else reads.bytes_read,
            posted_at_s=reads.posted_at_s if reads else None,
            post_s=reads.post_s if reads and reads.transfers else None,
            transfer_s=reads.transfer_s if reads and reads.transfers else None,
            detail=detail,
        )
        self._emit(record)

    def _emit(self, record: DecodeRecord | PrefillRecord) -> None:
        stats = getattr(self, "xfer_stats", None)
        if isinstance(record, DecodeRecord):
            if hasattr(stats, "record_request"):
                stats.record_request(record)
        elif hasattr(stats, "record_prefill_request"):
            stats.record_prefill_request(record)
        if self._records_on:
            records_logger.info("transfer record %s", record.to_json())

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
        self._forget_gone_requests()
        return results
