"""The prefill lease: until when decode may read a request's blocks.

No vLLM import. vLLM's prefill worker frees a request's blocks when decode
has not notified it within ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` seconds, and
may then reuse them for other requests. NIXL READ is one-sided: a decode that
reads after that gets another request's KV and cannot tell. So prefill puts
the lease's end, in wall-clock seconds, into ``kv_transfer_params``, and
decode refuses a read that would start, or did finish, within ``margin_s`` of
it (the margin absorbs clock skew between hosts and polling delay).
"""

from __future__ import annotations

__all__ = ["DEFAULT_MARGIN_S", "PARAM", "expired", "lease_deadline"]

#: key in kv_transfer_params
PARAM = "vllm_nixl_hma_lease_deadline"
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
