"""A read still in flight longer than it should be: found, counted, logged once (#43).

No vLLM import. Decode's worker gives up a read at ``read_timeout_s``
(``lease.abandon_read``); long before that, a read that is merely slow and one
that is stalled look the same from outside: a request waiting for its KV.
Every step, each read still in flight is measured against ``slow_read_s``
(``kv_connector_extra_config``, seconds, default ``DEFAULT_SLOW_READ_S``);
the first time it is over, the worker counts it
(``vllm:nixl_hma_decode_slow_reads_total``, and ``"slow": true`` in its
transfer record) and logs one warning (``describe``) with what the worker
and NIXL know of it then: the prefill engine and ranks, the kernel blocks
posted, NIXL's state of each handle. When the read ends, its record has
its bytes and NIXL's transfer time: a rate far below the link's is a stall,
not a slow link.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm_nixl_hma.core.config_values import seconds_or_null

__all__ = [
    "DEFAULT_SLOW_READ_S",
    "EXTRA_CONFIG_KEY",
    "configured_slow_read_s",
    "describe",
    "is_slow",
]

#: kv_connector_extra_config key
EXTRA_CONFIG_KEY = "slow_read_s"
#: seconds: a read of the KV of one prompt takes milliseconds on a data-center link;
#: one still in flight after this long is worth an operator's look
DEFAULT_SLOW_READ_S = 2.0


def configured_slow_read_s(extra_config: Mapping[str, Any] | None) -> float | None:
    """``slow_read_s`` from ``kv_connector_extra_config``: a positive number of
    seconds, ``null`` to count and log none, or the default when absent.
    ValueError naming the key and the value for anything else."""
    return seconds_or_null(
        extra_config, EXTRA_CONFIG_KEY, DEFAULT_SLOW_READ_S, "to count no read as slow"
    )


def is_slow(in_flight_s: float | None, slow_read_s: float | None) -> bool:
    """Whether a read ``in_flight_s`` seconds after it was posted is over the bound."""
    return slow_read_s is not None and in_flight_s is not None and in_flight_s > slow_read_s


def describe(
    request_id: str,
    in_flight_s: float,
    slow_read_s: float,
    *,
    engine_id: str | None,
    remote_tp_ranks: Sequence[int],
    kernel_blocks: int,
    handle_states: Sequence[str],
) -> str:
    """The one warning for a slow read, from what the worker knows of it at
    that step (its bytes are known only when NIXL reports it done: the
    transfer record then has ``bytes_read`` and ``transfer_s``)."""
    states = ", ".join(handle_states) or "none"
    return (
        f"NixlHMAConnector: the read of request {request_id} has been in flight for "
        f"{in_flight_s:.1f} s (slow_read_s {slow_read_s:g}): {kernel_blocks} kernel blocks "
        f"from engine {engine_id}, prefill rank(s) {list(remote_tp_ranks)}, in "
        f"{len(handle_states)} NIXL handle(s), NIXL's state: {states}. Counted in "
        "vllm:nixl_hma_decode_slow_reads_total and marked slow in its transfer record; "
        "read_timeout_s gives it up. A read of one prompt's KV takes milliseconds on a "
        "data-center link: seconds with the link up and other reads finishing is a stall "
        "(docs/faults.md, 'Slow and stalled reads')"
    )
