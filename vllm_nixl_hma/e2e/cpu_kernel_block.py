"""The one substitution ``vllm-nixl-hma e2e`` makes in the engines it starts.

On a GPU, FlashAttention and FlashInfer accept fixed kernel block sizes (16, 32,
64), so a hybrid model's logical block (sized so that one attention page holds
a Mamba state page) is several kernel blocks: ratios above 1, which differ
between TP sizes, which is where vLLM 0.21.0's P/D block mapping goes wrong.
vLLM's CPU attention backend accepts any multiple of 16, so on CPU the kernel
block is the logical block (ratio 1) and that code is never reached.

When ``VLLM_NIXL_HMA_CPU_KERNEL_BLOCK`` is set (``e2e`` sets it to 16 for every
engine it starts, reference included, unless ``--no-cpu-kernel-block``), the
plugin entry point, which vLLM runs in every process, makes
``CPUAttentionBackend.get_supported_kernel_block_sizes`` answer exactly that
size, as the GPU backends answer theirs; and, since vLLM 0.21.0's CPU backend
picks its kernel implementation from the *logical* block size
(``cpu_attn._get_attn_isa``: "vec" needs blocks of a multiple of 32, "vec16"
takes 16), that choice is made for the kernel block the cache is really cut
into. Nothing else changes; unset, nothing is touched.
"""

from __future__ import annotations

import os

ENV = "VLLM_NIXL_HMA_CPU_KERNEL_BLOCK"
_MARK = "_vllm_nixl_hma_kernel_block"


def apply_from_env() -> int | None:
    """Fix the CPU backend's kernel block to ``$VLLM_NIXL_HMA_CPU_KERNEL_BLOCK``
    tokens (idempotent); returns the size, or None when the variable is unset."""
    value = os.environ.get(ENV)
    if not value:
        return None
    tokens = int(value)
    if tokens < 16 or tokens % 16:
        raise ValueError(f"{ENV} must be a multiple of 16, got {value!r}")
    from vllm.v1.attention.backends import cpu_attn

    backend = cpu_attn.CPUAttentionBackend
    if getattr(backend, _MARK, None) != tokens:
        backend.get_supported_kernel_block_sizes = staticmethod(lambda: [tokens])
        choose_isa = getattr(cpu_attn._get_attn_isa, "__wrapped__", cpu_attn._get_attn_isa)

        def isa_for_kernel_block(dtype, block_size, *args, **kwargs):
            return choose_isa(dtype, tokens, *args, **kwargs)

        isa_for_kernel_block.__wrapped__ = choose_isa
        cpu_attn._get_attn_isa = isa_for_kernel_block
        setattr(backend, _MARK, tokens)
    return tokens
