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

vLLM 0.33 keeps the worker's code in ``nixl/base_worker.py`` (``nixl/worker.py``
is an alias there), reads the kernel block size through
``get_current_attn_backends_and_specs`` and lets the scheduler-side connector
(``nixl/base_scheduler.py``) decide on a host buffer from the platform's
device type: the same two substitutions are made in those modules, the
backend lookup answering with the layout's attention groups' specs. After a
read from a prefill of other TP, 0.33's worker moves block indices with
``async_tensor_h2d``, which pins host memory whenever the platform says it
can (``vllm.utils.torch_utils.PIN_MEMORY``); pinning needs a CUDA driver, so
that flag is set to what vLLM's CPU platform answers (False).

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
    from vllm_nixl_hma import _compat

    if _compat.builds_on("v033"):
        _substitute_v033(attention_backend)
        return
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import worker as nixl_worker

    if getattr(nixl_worker, _SUBSTITUTED_MARK, False):
        return
    nixl_worker.current_platform = CpuPlatformForNixl(nixl_worker.current_platform)
    nixl_worker.get_current_attn_backends = lambda *args, **kwargs: [attention_backend]
    setattr(nixl_worker, _SUBSTITUTED_MARK, True)


def _substitute_v033(attention_backend: type) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
        base_scheduler,
        base_worker,
    )
    from vllm.v1.kv_cache_interface import AttentionSpec

    def backends_and_specs(vllm_config, config, fallback):  # noqa: ARG001
        specs = [
            group.kv_cache_spec
            for group in config.transfer_groups
            if isinstance(group.kv_cache_spec, AttentionSpec)
        ]
        if not specs:
            return list(fallback), [None] * len(fallback)
        return [attention_backend] * len(specs), specs

    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils import torch_utils

    torch_utils.PIN_MEMORY = CpuPlatform.is_pin_memory_available()
    base_worker.get_current_attn_backends = lambda *args, **kwargs: [attention_backend]
    base_worker.get_current_attn_backends_and_specs = backends_and_specs
    for module in (base_worker, base_scheduler):
        if not getattr(module, _SUBSTITUTED_MARK, False):
            module.current_platform = CpuPlatformForNixl(module.current_platform)
            setattr(module, _SUBSTITUTED_MARK, True)
