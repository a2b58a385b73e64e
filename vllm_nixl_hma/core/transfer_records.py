"""What one request's KV transfer came to, as a log record and as counts (#27).

Pure: no vLLM, no torch, no NIXL. The glue builds one ``DecodeRecord`` per
request decode reads (or refuses, or fails) and one ``PrefillRecord`` per
request prefill served; ``OutcomeCounts`` is what those records add up to
between two stats reports, in a form vLLM's connector-stats mechanism can
carry between processes (a dict of numbers and lists of numbers).

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
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "REASONS",
    "DecodeRecord",
    "Outcome",
    "OutcomeCounts",
    "PrefillRecord",
    "Reason",
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
    #: KV cache groups read, kernel blocks read (both sides' pairs) and NIXL descriptors posted
    groups: int = 0
    kernel_blocks: int = 0
    descriptors: int = 0
    bytes_read: int = 0
    #: wall clock (seconds since the epoch) when the first read was posted
    posted_at_s: float | None = None
    #: NIXL's post time and transfer time, summed over this rank's reads
    post_s: float | None = None
    transfer_s: float | None = None
    #: the first line of the error, for a request that was not read
    detail: str | None = None

    def __post_init__(self) -> None:
        _check_outcome(self.outcome, self.reason)
        for name in ("local_tp_rank", "groups", "kernel_blocks", "descriptors", "bytes_read"):
            _check_count(name, getattr(self, name))
        for rank in self.remote_tp_ranks:
            _check_count("remote_tp_ranks", rank)
        for name in ("post_s", "transfer_s"):
            _check_seconds(name, getattr(self, name))
        if self.outcome is Outcome.REFUSED and (self.bytes_read or self.descriptors):
            raise ValueError(
                f"a refused request read nothing, but this one posted {self.descriptors} "
                f"descriptors and read {self.bytes_read} bytes"
            )

    def to_json(self) -> str:
        """One line of JSON (keys in field order, no NaN): ``event`` is
        ``"decode_read"``."""
        row: dict[str, Any] = {"event": "decode_read", **asdict(self)}
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
        row: dict[str, Any] = {"event": "prefill_served", **asdict(self)}
        row["readers"] = list(self.readers)
        return json.dumps(row, allow_nan=False, separators=(",", ":"))


def _key(outcome: Outcome, reason: Reason) -> str:
    return f"{outcome.value}/{reason.value}"


@dataclass
class OutcomeCounts:
    """Requests per (outcome, reason), and the bytes and transfer seconds of
    each request read, since the last report. ``data`` holds only strings,
    numbers and lists of numbers (what vLLM sends between processes)."""

    counts: dict[str, int] = field(default_factory=dict)
    bytes_read: list[int] = field(default_factory=list)
    transfer_s: list[float] = field(default_factory=list)

    def add(self, record: DecodeRecord) -> None:
        key = _key(record.outcome, record.reason)
        self.counts[key] = self.counts.get(key, 0) + 1
        if record.outcome is Outcome.READ:
            self.bytes_read.append(record.bytes_read)
            if record.transfer_s is not None:
                self.transfer_s.append(record.transfer_s)

    def merge(self, other: OutcomeCounts) -> OutcomeCounts:
        """Add ``other`` into this one (vLLM sums the ranks of an engine)."""
        for key, count in other.counts.items():
            self.counts[key] = self.counts.get(key, 0) + count
        self.bytes_read.extend(other.bytes_read)
        self.transfer_s.extend(other.transfer_s)
        return self

    def is_empty(self) -> bool:
        return not self.counts

    def by_outcome(self) -> dict[tuple[Outcome, Reason], int]:
        return {
            (Outcome(outcome), Reason(reason)): count
            for outcome, reason, count in (
                (*key.split("/", 1), count) for key, count in self.counts.items()
            )
        }

    def as_data(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "bytes_read": list(self.bytes_read),
            "transfer_s": list(self.transfer_s),
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any] | None) -> OutcomeCounts:
        """The counts another process sent (``as_data``); every key and value
        is checked, since a malformed report must not become a metric."""
        if not data:
            return cls()
        counts = dict(data.get("counts", {}))
        for key, count in counts.items():
            outcome, _, reason = str(key).partition("/")
            try:
                _check_outcome(Outcome(outcome), Reason(reason))
            except ValueError as e:
                raise ValueError(f"unknown outcome count {key!r}: {e}") from None
            _check_count(f"count of {key}", count)
        bytes_read = list(data.get("bytes_read", []))
        for value in bytes_read:
            _check_count("bytes_read", value)
        transfer_s = [float(v) for v in data.get("transfer_s", [])]
        for value in transfer_s:
            _check_seconds("transfer_s", value)
        return cls(counts, bytes_read, transfer_s)

    @classmethod
    def of(cls, records: Iterable[DecodeRecord]) -> OutcomeCounts:
        counts = cls()
        for record in records:
            counts.add(record)
        return counts
