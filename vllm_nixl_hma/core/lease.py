"""The prefill lease: until when decode may read a request's blocks.

No vLLM import. vLLM's prefill worker frees a request's blocks when decode
has not notified it within ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` seconds, and
may then reuse them for other requests. NIXL READ is one-sided: a decode that
reads after that gets another request's KV and cannot tell. So prefill puts
the lease's end, in wall-clock seconds, into ``kv_transfer_params``, and
decode refuses a read that would start, or did finish, within ``margin_s`` of
it (the margin absorbs clock skew between hosts and polling delay).

vLLM 0.33 has a lease of its own on prefill: ``kv_lease_duration`` seconds
from the request's end (prefill's scheduler ``perf_counter``), extended to
two thirds of that from each heartbeat decode's scheduler sends while the
request waits; a read after it is only logged on prefill. There prefill's
glue exports the deadline as vLLM's own ``remote_blocks_expiry_time`` and the
extension as ``EXTENSION_PARAM``; decode maps the deadline onto its clock with
the offset vLLM measured at the handshake, extends it from the heartbeats it
posted (``local_deadline``), and refuses as above.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from vllm_nixl_hma.core.blocks import has_local_blocks
from vllm_nixl_hma.core.config_values import seconds_or_null

__all__ = [
    "DEFAULT_MARGIN_S",
    "DEFAULT_READ_TIMEOUT_S",
    "READ_ABANDONED",
    "abandon_read",
    "configured_read_timeout_s",
    "EXTENSION_PARAM",
    "PARAM",
    "READ_FINISHED_LATE",
    "READ_REFUSED",
    "carried_by_request",
    "expired",
    "lease_deadline",
    "local_deadline",
    "configured_margin_s",
    "refuse_read",
    "missing_attribute_warning",
    "untrusted_read",
]

#: key in kv_transfer_params
PARAM = "vllm_nixl_hma_lease_deadline"
#: key in kv_transfer_params (vLLM 0.33): seconds a heartbeat extends prefill's lease by
EXTENSION_PARAM = "vllm_nixl_hma_lease_extension_s"
#: seconds before the deadline from which a read counts as too late;
#: kv_connector_extra_config "lease_margin_s" overrides it
DEFAULT_MARGIN_S = 5.0


def lease_deadline(now_wall_s: float, lease_s: float) -> float:
    """Wall-clock end of a lease that starts now."""
    return now_wall_s + lease_s


def expired(deadline_wall_s: float | None, now_wall_s: float, margin_s: float) -> bool:
    """True when a read at ``now_wall_s`` could find the blocks reused.

    A missing deadline (a prefill that does not send one) never expires.
    """
    if deadline_wall_s is None:
        return False
    return now_wall_s > deadline_wall_s - margin_s


def local_deadline(
    remote_deadline_s: float | None,
    clock_offset_s: float,
    last_heartbeat_local_s: float | None = None,
    extension_s: float | None = None,
) -> float | None:
    """vLLM 0.33: prefill's lease end on decode's clock.

    ``remote_deadline_s`` is on prefill's clock, ``clock_offset_s`` prefill's
    clock minus decode's (vLLM's handshake estimate). A heartbeat posted at
    ``last_heartbeat_local_s`` reaches prefill no earlier, so it extends the
    lease to at least that time plus ``extension_s`` (None: prefill did not
    say by how much; heartbeats then count for nothing). None: no lease.
    """
    if remote_deadline_s is None:
        return None
    deadline = remote_deadline_s - clock_offset_s
    if last_heartbeat_local_s is not None and extension_s is not None:
        deadline = max(deadline, last_heartbeat_local_s + extension_s)
    return deadline


#: logged (with the request id) when a read is refused at its start
READ_REFUSED = (
    "NixlHMAConnector: the prefill lease of request %s ended; its blocks may "
    "hold another request's KV, so they are not read"
)
#: logged (with the request id) when a finished read is not trusted
READ_FINISHED_LATE = (
    "NixlHMAConnector: the read of request %s finished after its prefill "
    "lease ended; its KV is not trusted"
)


def configured_margin_s(extra_config: Mapping[str, Any] | None) -> float:
    """``lease_margin_s`` from ``kv_connector_extra_config``, or the default."""
    return float((extra_config or {}).get("lease_margin_s", DEFAULT_MARGIN_S))


#: how long a read may stay in flight before decode abandons it, by default
DEFAULT_READ_TIMEOUT_S = 600.0

#: logged (request id, seconds in flight, reason) when a read in flight is abandoned
READ_ABANDONED = (
    "NixlHMAConnector: the read of request %s has been in flight for %.1f s (%s); it is "
    "abandoned, its blocks are not trusted and the prefill engine's agents are released"
)


def configured_read_timeout_s(extra_config: Mapping[str, Any] | None) -> float | None:
    """``read_timeout_s`` from ``kv_connector_extra_config`` (a positive number
    of seconds, or ``null`` for no limit beyond the lease), or the default;
    ValueError naming the key for anything else (the config is the
    operator's, read at start)."""
    return seconds_or_null(
        extra_config, "read_timeout_s", DEFAULT_READ_TIMEOUT_S, "for no limit beyond the lease"
    )


def abandon_read(
    deadline_s: float | None,
    now_s: float,
    margin_s: float,
    in_flight_s: float | None,
    read_timeout_s: float | None,
) -> str | None:
    """Decode's rule for a read still in flight, on both releases: why it is
    given up now, or None. ``lease``: the lease ends within ``margin_s``, so
    the read could not be trusted when it ends (``untrusted_read``);
    ``timeout``: it has been in flight ``read_timeout_s`` (a prefill host
    that vanished without a reset leaves a read in flight for as long as
    its transport keeps the connection)."""
    if expired(deadline_s, now_s, margin_s):
        return "lease"
    if read_timeout_s is not None and in_flight_s is not None and in_flight_s >= read_timeout_s:
        return "timeout"
    return None


def refuse_read(
    deadline_s: float | None,
    now_s: float,
    margin_s: float,
    local_block_ids_by_group: Sequence[Sequence[int]],
) -> bool:
    """Decode's rule at a read's start, on both releases: refuse a request
    with blocks to read whose lease ends within ``margin_s`` of now. A
    request with no local block reads nothing (it only notifies prefill) and
    is never refused; one without a deadline never expires."""
    return has_local_blocks(local_block_ids_by_group) and expired(deadline_s, now_s, margin_s)


def untrusted_read(deadline_s: float | None, finished_s: float, margin_s: float) -> bool:
    """Decode's rule at a read's end: a read that finished within
    ``margin_s`` of the lease's end may have read reused blocks."""
    return expired(deadline_s, finished_s, margin_s)


def carried_by_request(
    entries: Iterable[tuple[str | None, Mapping[str, Any] | None]], param: str
) -> dict[str, Any]:
    """What our scheduler side hands its workers with vLLM's connector
    metadata: ``{key: params[param]}`` for each ``(key, kv_transfer_params)``
    whose params carry ``param`` (vLLM's per-request metadata keeps vLLM's
    own fields only). Entries without a key are skipped."""
    carried = {}
    for key, params in entries:
        if key is not None and params and param in params:
            carried[key] = params[param]
    return carried


def missing_attribute_warning(attribute: str, consequence: str) -> str:
    """The warning a worker logs once when connector metadata with requests to
    receive lacks the attribute our scheduler side always sets."""
    return (
        f"NixlHMAConnector: the connector metadata carries no {attribute} (not built by "
        "NixlHMAConnector's scheduler side, or this vLLM drops attributes on its way to the "
        f"worker); {consequence}"
    )
