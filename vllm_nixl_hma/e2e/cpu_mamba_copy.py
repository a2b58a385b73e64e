"""The fourth substitution ``vllm-nixl-hma e2e`` makes in the engines it starts.

In Mamba cache mode ``align`` (prefix caching of a Mamba hybrid), vLLM 0.21.0's
model runner copies a request's running state into the block of the step it
computes next, and into each block a step fills (``mamba_utils.preprocess_mamba``
and ``postprocess_mamba``), through ``batch_memcpy``: a Triton kernel, which
vLLM's CPU build cannot launch (no Triton driver on CPU). The engine then dies
on its first step that crosses a block boundary (``TypeError: 'function'
object is not subscriptable``; measured on this project's host with the
embedded GatedDeltaNet hybrid).

When ``VLLM_NIXL_HMA_CPU_MAMBA_COPY`` is set (``e2e`` sets it for every engine
it starts), the plugin entry point gives ``mamba_utils`` a ``batch_memcpy``
that copies the same (source pointer, destination pointer, bytes) rows with
``ctypes.memmove``, which is what the kernel does with GPU memory. Unset,
nothing is touched; on a GPU vLLM's kernel runs as shipped.
"""

from __future__ import annotations

import ctypes
import os

ENV = "VLLM_NIXL_HMA_CPU_MAMBA_COPY"
_MARK = "_vllm_nixl_hma_cpu_mamba_copy"


def batch_memcpy(src_ptrs, dst_ptrs, sizes) -> None:
    """``mamba_utils.batch_memcpy`` for host memory: row ``i`` copies
    ``sizes[i]`` bytes from address ``src_ptrs[i]`` to ``dst_ptrs[i]``."""
    sources, destinations, counts = src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()
    if not len(sources) == len(destinations) == len(counts):
        raise ValueError(
            f"batch_memcpy rows differ: {len(sources)} sources, {len(destinations)} "
            f"destinations, {len(counts)} sizes"
        )
    for source, destination, count in zip(sources, destinations, counts, strict=True):
        ctypes.memmove(destination, source, count)


def apply_from_env() -> bool:
    """Give vLLM's Mamba state copies a host-memory ``batch_memcpy`` (idempotent);
    returns whether ``$VLLM_NIXL_HMA_CPU_MAMBA_COPY`` asked for it."""
    if not os.environ.get(ENV):
        return False
    from vllm.v1.worker import mamba_utils

    if not getattr(mamba_utils, _MARK, False):
        mamba_utils.batch_memcpy = batch_memcpy
        setattr(mamba_utils, _MARK, True)
    return True
