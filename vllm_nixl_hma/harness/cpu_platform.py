"""Everything substituted to run vLLM 0.21.0's NIXL worker off-GPU, in one place.

vLLM on a machine without a GPU reports an "unspecified" platform. The NIXL
worker module (vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker) reads
two things from its module globals that then do not fit:

* ``current_platform``: replaced, in that module only, by a proxy that says
  device type "cpu", reports no NUMA topology (otherwise the worker pins the
  process to one core), no NIXL memory-type override (so
  ``kv_buffer_device="cpu"`` registers DRAM) and makes ``set_device`` a no-op;
  every other attribute is the real platform's.
* ``get_current_attn_backends``: replaced by a function returning the
  attention backend class the layout was built for (FlashInfer's class, which
  imports on CPU and has fixed kernel block sizes 16/32/64, so the
  kernel-per-logical ratio can exceed 1 as on a GPU).

With ``device="cuda"`` nothing is substituted: the real platform and backend
lookup are used. Harness processes are dedicated to the harness; the
substitution is made once per process and never undone.
"""

from __future__ import annotations

from typing import Any

_SUBSTITUTED_MARK = "_vllm_nixl_hma_cpu_substituted"


class CpuPlatformForNixl:
    """The real platform, except for what the NIXL worker must see on CPU."""

    device_type = "cpu"

    def __init__(self, real: Any):
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def discover_numa_topology(self) -> list[list[int]]:
        return []

    def get_nixl_memory_type(self) -> None:
        return None

    def set_device(self, device: Any) -> None:
        return None


def substitute_for_cpu(attention_backend: type) -> None:
    """Make the NIXL worker module runnable on CPU (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import worker as nixl_worker

    if getattr(nixl_worker, _SUBSTITUTED_MARK, False):
        return
    nixl_worker.current_platform = CpuPlatformForNixl(nixl_worker.current_platform)
    nixl_worker.get_current_attn_backends = lambda *args, **kwargs: [attention_backend]
    setattr(nixl_worker, _SUBSTITUTED_MARK, True)
