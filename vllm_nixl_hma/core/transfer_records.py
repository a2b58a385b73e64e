"""What one request's KV transfer came to, as a log record and as counts (#27).

Pure: no vLLM, no torch, no NIXL. The glue builds one ``DecodeRecord`` per
request decode reads (or refuses, or fails) and one ``PrefillRecord`` per
request prefill served; ``OutcomeCounts`` is what those records add up to
between two stats reports, in the form vLLM's NIXL connector stats carry
between processes and add up across ranks (a dict of lists).

Outcomes and reasons are closed sets: they become Prometheus label values,
so a request id, an engine id or an error text never does (bounded
cardinality). Every outcome admits only some reasons (``REASONS``): a read
has none; a refusal is decided by decode before a byte is read; a failure
happens to a read that was set up or posted; an expiry is prefill's lease
ending before the read was safe; a recompute is a failed or refused load
that vLLM's ``kv_load_failure_policy`` ``recompute`` turned into local
prefill, named by the reason it failed for.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "DATA_KEYS",
    "DECODE_SLOW_READS",
    "REASONS",
    "DecodeRecord",
    "Outcome",
    "OutcomeCounts",
    "PrefillRecord",
    "Reason",
    "outcome_of",
    "reason_of_handshake_error",
]


class Outcome(enum.Enum):
    READ = "read"
    REFUSED = "refused"
    FAILED = "failed"
    EXPIRED = "expired"
    RECOMPUTED = "recomputed"


class Reason(enum.Enum):
    NONE = "none"
    #: a field of prefill's handshake record or agent metadata differs from decode's
    HANDSHAKE = "handshake"
    #: a stock NixlConnector prefill whose KV decode cannot place
    STOCK_PEER = "stock_peer"
    #: prefill's side-channel host or this host's UCX devices refused before dialing
    ADDRESS = "address"
    #: the request's transfer ticket is missing, forged, edited, expired or replayed
    TICKET = "ticket"
    #: the block lists (or the token span) of decode and prefill do not pair
    UNPAIRABLE = "unpairable"
    #: prefill's side channel did not answer, or the handshake broke off
    UNREACHABLE = "unreachable"
    #: NIXL could not set up, post or finish the read
    TRANSFER = "transfer"
    #: still in flight ``read_timeout_s`` after it was posted
    TIMEOUT = "timeout"
    #: prefill's lease ends within decode's margin: not read
    LEASE = "lease"
    #: the read finished after prefill's lease ended, or was in flight at its margin
    LATE_READ = "late_read"


_REFUSALS = frozenset(
    {
        Reason.HANDSHAKE,
        Reason.STOCK_PEER,
        Reason.ADDRESS,
        Reason.TICKET,
        Reason.UNPAIRABLE,
    }
)
_FAILURES = frozenset({Reason.UNREACHABLE, Reason.TRANSFER, Reason.TIMEOUT})
_EXPIRIES = frozenset({Reason.LEASE, Reason.LATE_READ})
#: the reasons each outcome admits
REASONS: Mapping[Outcome, frozenset[Reason]] = {
    Outcome.READ: frozenset({Reason.NONE}),
    Outcome.REFUSED: _REFUSALS,
    Outcome.FAILED: _FAILURES,
    Outcome.EXPIRED: _EXPIRIES,
    Outcome.RECOMPUTED: _REFUSALS | _FAILURES | _EXPIRIES,
}


def _check_outcome(outcome: Outcome, reason: Reason) -> None:
    if reason not in REASONS[outcome]:
        raise ValueError(
            f"outcome {outcome.value!r} cannot have reason {reason.value!r} "
            f"(it admits {sorted(r.value for r in REASONS[outcome])})"
        )


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")


def _check_seconds(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")


@dataclass(frozen=True)
class DecodeRecord:
    """One request on one decode TP rank: what it read from which prefill
    engine, how long that took, and how it ended."""

    request_id: str
    outcome: Outcome
    reason: Reason = Reason.NONE
    remote_engine_id: str | None = None
    remote_host: str | None = None
    local_tp_rank: int = 0
    #: the prefill TP ranks this decode rank read from (or would have)
    remote_tp_ranks: tuple[int, ...] = ()
    #: KV cache groups read, local kernel block ids handed to the reads (every group) and
    #: NIXL descriptors moved (its telemetry)
    groups: int = 0
    kernel_blocks: int = 0
    descriptors: int = 0
    bytes_read: int = 0
    #: wall clock (seconds since the epoch) when the first read was posted
    posted_at_s: float | None = None
    #: NIXL's post time and transfer time, summed over this rank's reads
    post_s: float | None = None
    transfer_s: float | None = None
    #: wall clock from the first read posted to the step that saw the request end
    #: (done, failed or given up): what the request waited for its KV on this rank
    read_s: float | None = None
    #: still in flight ``slow_read_s`` after it was posted (``core.slow_reads``)
    slow: bool = False
    #: the first line of the error, for a request that was not read
    detail: str | None = None

    def __post_init__(self) -> None:
        _check_outcome(self.outcome, self.reason)
        if not isinstance(self.slow, bool):
            raise ValueError(f"slow must be true or false, got {self.slow!r}")
        for name in ("local_tp_rank", "groups", "kernel_blocks", "descriptors", "bytes_read"):
            _check_count(name, getattr(self, name))
        for rank in self.remote_tp_ranks:
            _check_count("remote_tp_ranks", rank)
        for name in ("post_s", "transfer_s", "read_s"):
            _check_seconds(name, getattr(self, name))
        if self.outcome is Outcome.REFUSED and (self.bytes_read or self.descriptors):
            raise ValueError(
                f"a refused request read nothing, but this one posted {self.descriptors} "
                f"descriptors and read {self.bytes_read} bytes"
            )

    def to_json(self) -> str:
        """One line of JSON (keys in field order, no NaN): ``event`` is
        ``"decode_read"``."""
        row: dict[str, Any] = {"event": "decode_read", **_shallow_row(self)}
        row["outcome"] = self.outcome.value
        row["reason"] = self.reason.value
        row["remote_tp_ranks"] = list(self.remote_tp_ranks)
        return json.dumps(row, allow_nan=False, separators=(",", ":"))


@dataclass(frozen=True)
class PrefillRecord:
    """One request on one prefill TP rank: who read its blocks and how they
    were freed (every expected reader's notification, or the lease)."""

    request_id: str
    #: the decode requests' notifications (agent names), in the order they came
    readers: tuple[str, ...] = ()
    readers_expected: int = 0
    #: "notified" (every expected reader notified) or "lease" (freed when it ran out)
    freed_by: str = "notified"
    held_s: float | None = None

    def __post_init__(self) -> None:
        if self.freed_by not in ("notified", "lease"):
            raise ValueError(f"freed_by must be 'notified' or 'lease', got {self.freed_by!r}")
        _check_count("readers_expected", self.readers_expected)
        _check_seconds("held_s", self.held_s)
        if self.freed_by == "notified" and len(self.readers) < self.readers_expected:
            raise ValueError(
                f"freed on notification by {len(self.readers)} of "
                f"{self.readers_expected} expected readers"
            )

    def to_json(self) -> str:
        row: dict[str, Any] = {"event": "prefill_served", **_shallow_row(self)}
        row["readers"] = list(self.readers)
        return json.dumps(row, allow_nan=False, separators=(",", ":"))


def _shallow_row(record: Any) -> dict[str, Any]:
    """A record's fields by name, in field order: ``dataclasses.asdict``
    without its deep copy of every value (the fields are scalars and tuples,
    which ``to_json`` turns into lists), a third of a record's cost in
    decode's step (benchmarks/records.py)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


def _key(outcome: Outcome, reason: Reason) -> str:
    return f"{outcome.value}/{reason.value}"


#: {(outcome, reason): "outcome/reason"} for every allowed pair
OUTCOME_KEYS = {
    (outcome, reason): _key(outcome, reason)
    for outcome, reasons in REASONS.items()
    for reason in reasons
}
_READ_KEY = OUTCOME_KEYS[Outcome.READ, Reason.NONE]


def outcome_of(reason: Reason, *, recompute: bool) -> Outcome:
    """The outcome of a request decode did not read, from the reason it was
    not read and vLLM's ``kv_load_failure_policy`` (``recompute``: the
    scheduler computes the request's prompt itself instead)."""
    if reason is Reason.NONE:
        raise ValueError("a request that was not read has a reason")
    if recompute:
        return Outcome.RECOMPUTED
    for outcome in (Outcome.REFUSED, Outcome.FAILED, Outcome.EXPIRED):
        if reason in REASONS[outcome]:
            return outcome
    raise ValueError(f"reason {reason.value!r} belongs to no outcome")  # pragma: no cover


#: the attribute an error raised at handshake may carry to name its reason
REASON_ATTR = "record_reason"


def reason_of_handshake_error(error: BaseException) -> Reason:
    """The reason a handshake that raised ``error`` failed: the error's own
    ``record_reason`` where it has one (``addresses``' refusals, a stock
    peer refused, a side channel that did not answer); ``unreachable`` for
    an error of the side channel's network (an ``OSError``, such as a
    refused connection or a timeout, or one of ZeroMQ's, such as its receive
    timeout); ``transfer`` for one of NIXL's (loading prefill's agent failed
    in NIXL's backend: UCX could not reach prefill's data path, as when only
    that network is cut); and ``handshake`` for any other: a refusal of what
    prefill sent, ours (``IncompatibleRemoteError``, naming the field) or
    upstream's (0.33's compatibility-hash, engine-id and decoding checks
    raise ``RuntimeError``)."""
    named = getattr(error, REASON_ATTR, None)
    if isinstance(named, Reason):
        return named
    if isinstance(error, OSError) or _raised_by(error, "zmq"):
        return Reason.UNREACHABLE
    if _raised_by(error, "nixl"):
        return Reason.TRANSFER
    return Reason.HANDSHAKE


def _raised_by(error: BaseException, package: str) -> bool:
    """Whether ``error`` is an exception class of ``package`` (pyzmq's
    ``zmq.ZMQError`` and subclasses such as ``zmq.Again``; NIXL's
    ``nixl*Error`` from ``nixl._bindings``, ``nixl_cu12._bindings`` or
    ``nixl_cu13._bindings``, by the wheel), without importing either here."""
    for cls in type(error).__mro__:
        top = cls.__module__.split(".")[0]
        if package == "zmq" and top == "zmq" and cls.__name__ == "ZMQError":
            return True
        if package == "nixl" and top.startswith("nixl") and cls.__name__.startswith("nixl"):
            return True
    return False


#: ``OutcomeCounts`` as vLLM's connector stats carry it (``as_data``): every
#: value a list, so that vLLM's ``NixlKVConnectorStats.aggregate`` (which
#: extends each list by the other's) sums ranks and intervals unchanged
DECODE_OUTCOMES = "hma_decode_outcomes"
DECODE_BYTES = "hma_decode_bytes"
DECODE_TRANSFER_S = "hma_decode_transfer_s"
PREFILL_FREED = "hma_prefill_freed"
#: one 1 per read found in flight past ``slow_read_s`` (counted when found)
DECODE_SLOW_READS = "hma_decode_slow_reads"
DATA_KEYS = (DECODE_OUTCOMES, DECODE_BYTES, DECODE_TRANSFER_S, PREFILL_FREED, DECODE_SLOW_READS)
FREED_BY = ("notified", "lease")


@dataclass
class OutcomeCounts:
    """What the records of one interval add up to: one ``"outcome/reason"``
    per decode record, the bytes and transfer seconds of each request read,
    and how prefill freed each request it served (``"notified"`` or
    ``"lease"``), and a 1 for each read found slow (``slow_reads``, counted
    when found, while the read is still in flight). Lists, not counts:
    vLLM's NIXL stats aggregate by extending lists, and these travel inside
    them (``as_data``)."""

    outcomes: list[str] = field(default_factory=list)
    bytes_read: list[int] = field(default_factory=list)
    transfer_s: list[float] = field(default_factory=list)
    prefill_freed: list[str] = field(default_factory=list)
    slow_reads: list[int] = field(default_factory=list)

    def add(self, record: DecodeRecord) -> None:
        self.count(record.outcome, record.reason, record.bytes_read, record.transfer_s)

    def count(
        self, outcome: Outcome, reason: Reason, bytes_read: int, transfer_s: float | None
    ) -> None:
        """One decode request, as ``add`` counts its record, without one."""
        self.count_many(((outcome, reason, bytes_read, transfer_s),))

    def count_many(self, counts: Iterable[tuple[Outcome, Reason, int, float | None]]) -> None:
        """``count`` for each ``(outcome, reason, bytes_read, transfer_s)``.
        Decode's step counts every request it read this way: a request read
        takes no dict lookup (``Enum.__hash__`` is Python, two calls a key)."""
        outcomes, bytes_read, transfer_s = self.outcomes, self.bytes_read, self.transfer_s
        read, none = Outcome.READ, Reason.NONE
        for outcome, reason, nbytes, seconds in counts:
            if outcome is read and reason is none:
                key = _READ_KEY
            else:
                key = OUTCOME_KEYS.get((outcome, reason))
                if key is None:
                    _check_outcome(outcome, reason)  # raises, naming the pair
            outcomes.append(key)
            if outcome is read:
                bytes_read.append(nbytes)
                if seconds is not None:
                    transfer_s.append(seconds)

    def add_prefill(self, record: PrefillRecord) -> None:
        self.prefill_freed.append(record.freed_by)

    def count_slow_read(self) -> None:
        """One read found in flight past ``slow_read_s``."""
        self.slow_reads.append(1)

    def merge(self, other: OutcomeCounts) -> OutcomeCounts:
        """Add ``other`` into this one (vLLM sums the ranks of an engine)."""
        self.outcomes.extend(other.outcomes)
        self.bytes_read.extend(other.bytes_read)
        self.transfer_s.extend(other.transfer_s)
        self.prefill_freed.extend(other.prefill_freed)
        self.slow_reads.extend(other.slow_reads)
        return self

    def is_empty(self) -> bool:
        return not (self.outcomes or self.prefill_freed or self.slow_reads)

    def counts(self) -> dict[str, int]:
        """``{"outcome/reason": requests}``"""
        counts: dict[str, int] = {}
        for key in self.outcomes:
            counts[key] = counts.get(key, 0) + 1
        return counts

    def prefill_counts(self) -> dict[str, int]:
        return {freed_by: self.prefill_freed.count(freed_by) for freed_by in FREED_BY}

    def by_outcome(self) -> dict[tuple[Outcome, Reason], int]:
        return {
            (Outcome(outcome), Reason(reason)): count
            for outcome, reason, count in (
                (*key.split("/", 1), count) for key, count in self.counts().items()
            )
        }

    def as_data(self) -> dict[str, list]:
        return {
            DECODE_OUTCOMES: list(self.outcomes),
            DECODE_BYTES: list(self.bytes_read),
            DECODE_TRANSFER_S: list(self.transfer_s),
            PREFILL_FREED: list(self.prefill_freed),
            DECODE_SLOW_READS: list(self.slow_reads),
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any] | None) -> OutcomeCounts:
        """The counts another process sent (``as_data``, possibly inside
        vLLM's stats dict, whose other keys are ignored); every value is
        checked, since a malformed report must not become a metric."""
        if not data:
            return cls()
        outcomes = [str(key) for key in data.get(DECODE_OUTCOMES) or []]
        for key in outcomes:
            outcome, _, reason = key.partition("/")
            try:
                _check_outcome(Outcome(outcome), Reason(reason))
            except ValueError as e:
                raise ValueError(f"unknown outcome {key!r}: {e}") from None
        bytes_read = list(data.get(DECODE_BYTES) or [])
        for value in bytes_read:
            _check_count("bytes_read", value)
        transfer_s = [float(v) for v in data.get(DECODE_TRANSFER_S) or []]
        for value in transfer_s:
            _check_seconds("transfer_s", value)
        prefill_freed = [str(v) for v in data.get(PREFILL_FREED) or []]
        for value in prefill_freed:
            if value not in FREED_BY:
                raise ValueError(f"unknown way prefill freed a request: {value!r}")
        slow_reads = list(data.get(DECODE_SLOW_READS) or [])
        for value in slow_reads:
            if value != 1 or isinstance(value, bool):
                raise ValueError(f"a slow read is counted as 1, got {value!r}")
        return cls(outcomes, bytes_read, transfer_s, prefill_freed, slow_reads)

    @classmethod
    def of(cls, records: Iterable[DecodeRecord]) -> OutcomeCounts:
        counts = cls()
        for record in records:
            counts.add(record)
        return counts
