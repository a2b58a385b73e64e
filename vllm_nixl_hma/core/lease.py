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

__all__ = [
    "DEFAULT_MARGIN_S",
    "EXTENSION_PARAM",
    "PARAM",
    "expired",
    "lease_deadline",
    "local_deadline",
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
