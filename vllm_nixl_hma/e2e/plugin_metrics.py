"""The plugin's counters as an engine's /metrics shows them, and its
per-request records as an engine's log holds them (#27): parsed, compared,
and what each e2e fault must leave there under each policy. Pure: text in,
numbers out."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

__all__ = [
    "FAULT_REASONS",
    "allowed_keys",
    "counts_from_log",
    "counts_from_metrics",
    "delta",
    "fault_records_ok",
    "reads_from_log",
    "records_match",
    "slowest_reads",
]

#: a sample of one of the plugin's counters: name, labels, value
_SAMPLE = re.compile(
    r"^(vllm:nixl_hma_(?:decode_requests_total|prefill_requests_total|"
    r"decode_request_bytes_count|decode_request_bytes_sum|decode_slow_reads_total))"
    r"(\{[^}]*\})?\s+(\S+)$",
    re.M,
)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_RECORD = re.compile(r"transfer record (\{.*\})\s*$", re.M)


def counts_from_metrics(text: str) -> dict[str, int]:
    """``{"decode/outcome/reason": n, "prefill/freed_by": n, "decode_bytes":
    n, "decode_reads": n, "decode_slow_reads": n}`` from /metrics text,
    summed over vLLM's label sets
    (``engine``: DP ranks); zero counts left out."""
    counts: dict[str, int] = {}
    for name, labels_text, value in _SAMPLE.findall(text):
        labels = dict(_LABEL.findall(labels_text or ""))
        if name.endswith("decode_requests_total"):
            key = f"decode/{labels.get('outcome')}/{labels.get('reason')}"
        elif name.endswith("prefill_requests_total"):
            key = f"prefill/{labels.get('freed_by')}"
        elif name.endswith("_bytes_sum"):
            key = "decode_bytes"
        elif name.endswith("decode_slow_reads_total"):
            key = "decode_slow_reads"
        else:
            key = "decode_reads"
        number = int(float(value))
        if number:
            counts[key] = counts.get(key, 0) + number
    return counts


def counts_from_log(text: str) -> dict[str, int]:
    """The same counts from the ``transfer record`` JSON lines of an engine's
    log (``"transfer_records": true``); a line that is not a record is
    skipped, a record that does not parse raises ValueError."""
    counts: dict[str, int] = {}

    def add(key: str, number: int = 1) -> None:
        counts[key] = counts.get(key, 0) + number

    for line in _RECORD.findall(text):
        record = json.loads(line)
        if record.get("event") == "decode_read":
            add(f"decode/{record['outcome']}/{record['reason']}")
            if record["outcome"] == "read":
                add("decode_reads")
                if record["bytes_read"]:
                    add("decode_bytes", int(record["bytes_read"]))
            if record.get("slow"):
                add("decode_slow_reads")
        elif record.get("event") == "prefill_served":
            add(f"prefill/{record['freed_by']}")
        else:
            raise ValueError(f"not a transfer record: {line[:200]}")
    return counts


def reads_from_log(text: str) -> list[dict[str, object]]:
    """Each of decode's reads in an engine's log, in its order: ``{"request_id",
    "outcome", "reason", "bytes_read", "transfer_s", "read_s", "slow"}`` from the ``decode_read``
    records (``transfer_s``: NIXL's transfer time of the read's handles, as
    the worker measured it; ``None`` where the read never ended, e.g. it was
    abandoned at ``read_timeout_s``). Other records are left out."""
    reads = []
    for line in _RECORD.findall(text):
        record = json.loads(line)
        if record.get("event") != "decode_read":
            continue
        reads.append(
            {
                "request_id": record["request_id"],
                "outcome": record["outcome"],
                "reason": record["reason"],
                "bytes_read": record.get("bytes_read"),
                "transfer_s": record.get("transfer_s"),
                "read_s": record.get("read_s"),
                "slow": bool(record.get("slow")),
            }
        )
    return reads


def slowest_reads(reads_by_engine: Mapping[str, list[Mapping[str, object]]], count: int = 3):
    """The ``count`` reads that took longest over every engine, longest first,
    each with its engine's name (``engine``). A read's time is ``read_s``
    (the request's wall-clock wait for its KV on that rank), or where a
    record has none ``transfer_s`` (NIXL's time, its handles summed); reads
    with neither are left out."""

    def seconds(read: Mapping[str, object]) -> float | None:
        for key in ("read_s", "transfer_s"):
            value = read.get(key)
            if isinstance(value, (int, float)):
                return float(value)
        return None

    timed = [
        {"engine": name, **read, "seconds": seconds(read)}
        for name, reads in reads_by_engine.items()
        for read in reads
        if seconds(read) is not None
    ]
    return sorted(timed, key=lambda read: -read["seconds"])[:count]


def delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """What grew between two readings (nothing shrinks: counters)."""
    keys = set(before) | set(after)
    grown = {key: after.get(key, 0) - before.get(key, 0) for key in keys}
    return {key: n for key, n in sorted(grown.items()) if n}


#: the reasons decode's records may give for the broken request of each e2e
#: fault (its outcome follows from the policy: refused, failed or expired
#: under ``fail``, recomputed under ``recompute``)
FAULT_REASONS: dict[str, frozenset[str]] = {
    "side-channel-unreachable": frozenset({"unreachable"}),
    "lease-expired": frozenset({"lease"}),
    "unpairable-block-lists": frozenset({"unpairable"}),
    "other-request-ticket": frozenset({"ticket"}),
    "edited-ticket": frozenset({"ticket"}),
    "replayed-ticket": frozenset({"ticket"}),
    "fake-prefill-ticket": frozenset({"ticket"}),
    # a read posted to a dead engine fails to post or to finish; where decode
    # released prefill's agents before (a failed cell just before), its new
    # handshake finds the side channel closed
    "prefill-killed": frozenset({"transfer", "unreachable"}),
    "prefill-host-gone": frozenset({"transfer", "timeout", "late_read", "unreachable"}),
    "prefill-data-path-cut": frozenset({"transfer", "timeout", "late_read", "unreachable"}),
    "prefill-link-flap": frozenset({"transfer", "timeout", "late_read"}),
}
_OUTCOMES_UNDER_FAIL = {
    "unreachable": "failed",
    "transfer": "failed",
    "timeout": "failed",
    "lease": "expired",
    "late_read": "expired",
    "unpairable": "refused",
    "ticket": "refused",
    "handshake": "refused",
    "stock_peer": "refused",
    "address": "refused",
}


def allowed_keys(fault: str, policy: str) -> set[str]:
    """The ``decode/outcome/reason`` keys fault ``fault``'s broken request may
    leave under ``policy``."""
    return {
        f"decode/{'recomputed' if policy == 'recompute' else _OUTCOMES_UNDER_FAIL[r]}/{r}"
        for r in FAULT_REASONS[fault]
    }


def fault_records_ok(fault: str, policy: str, grown: Mapping[str, int], may_deliver: bool) -> bool:
    """The decode engine's counters over one fault cell (the broken request
    and the next one, which repeats its prompt): the broken request is
    counted under one of the fault's own keys (or read, where the fault may
    deliver). Under ``fail`` nothing else but reads may be counted. Under
    ``recompute`` another request's recomputation may be counted too (the
    next request is answered right either way, and its count stays in the
    cell's ``records`` for the report): on the hybrid with prefix caching,
    the next request's read of the same prompt was once held until
    ``read_timeout_s`` while decode recomputed the broken one
    (docs/testing.md)."""
    not_read = {key for key in grown if key.startswith("decode/") and key != "decode/read/none"}
    if not not_read:
        return may_deliver
    own = allowed_keys(fault, policy)
    if policy == "recompute":
        return bool(not_read & own)
    return not_read <= own


def records_match(metrics: Mapping[str, int], log: Mapping[str, int]) -> bool:
    """An engine's /metrics counts equal what its log's records add up to."""
    return dict(metrics) == dict(log)
