"""How many of NIXL's UCX threads one read may use (no vLLM import).

NIXL 1.x's UCX backend, created with ``num_threads`` > 0 (vLLM asks for 4),
posts a transfer of up to ``split_batch_size`` descriptors on one worker
thread and splits a longer one into chunks of ``split_batch_size``
descriptors, one per shared thread. NIXL's default is 1024 descriptors.

Upstream's reads carry two descriptors per kernel page per layer, so any
request past a few thousand tokens has more than 1024 and is spread over all
threads. Our run descriptors (``page_runs``) carry whole logical blocks: 480
descriptors move 130 MiB, so the read stays on one thread and is slower than
upstream's although it posts a 17th of the descriptors. Measured on a 2-core
host, UCX over loopback (CMA copies), 480 descriptors of 288 KiB: 2.35 GB/s
with NIXL's default, 4.3-5.1 GB/s with a split of 8 to 128 descriptors; 8320
descriptors of 16 KiB (upstream's plan of the same bytes) move 2.8-3.3 GB/s
at every split from 8 to 1024. So our agent asks for a split that spreads a
request's runs over the threads, ``DEFAULT_SPLIT_BATCH_SIZE``, unless the
user sets ``split_batch_size`` in ``kv_connector_extra_config``.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm_nixl_hma.core.config_values import whole_number

__all__ = [
    "DEFAULT_SPLIT_BATCH_SIZE",
    "EXTRA_CONFIG_KEY",
    "split_batch_size_from",
    "ucx_backend_params",
]

#: kv_connector_extra_config key, named after NIXL's UCX backend parameter
EXTRA_CONFIG_KEY = "split_batch_size"
#: descriptors per chunk our agents ask NIXL for (NIXL's own default: 1024)
DEFAULT_SPLIT_BATCH_SIZE = 32


def split_batch_size_from(extra_config: Mapping[str, object] | None) -> int:
    """``split_batch_size`` from ``kv_connector_extra_config``: a whole number
    of descriptors >= 1, ``DEFAULT_SPLIT_BATCH_SIZE`` when absent.

    Raises ``ValueError`` naming the key and the value for anything else
    (a bool, a fraction, text that is not a number, zero or less).
    """
    value = (extra_config or {}).get(EXTRA_CONFIG_KEY, DEFAULT_SPLIT_BATCH_SIZE)
    count = whole_number(value)
    if count is None or count < 1:
        raise ValueError(
            f"kv_connector_extra_config {EXTRA_CONFIG_KEY}={value!r}: expected a whole "
            f"number of descriptors >= 1 (default {DEFAULT_SPLIT_BATCH_SIZE}; NIXL's own "
            "default is 1024)"
        )
    return count


def ucx_backend_params(num_threads: int, split_batch_size: int) -> dict[str, str]:
    """NIXL's UCX backend parameters for an agent with ``num_threads`` shared
    threads that splits reads into chunks of ``split_batch_size`` descriptors."""
    if num_threads < 1 or split_batch_size < 1:
        raise ValueError(
            f"num_threads={num_threads}, split_batch_size={split_batch_size}: both must be >= 1"
        )
    return {"num_threads": str(num_threads), "split_batch_size": str(split_batch_size)}
