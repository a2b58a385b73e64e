"""The third substitution ``vllm-nixl-hma e2e`` makes in the engines it starts:
vLLM 0.21.0's CPU fused-MoE layer, on hosts with AMX.

``CPUFusedMOE.check_grouped_gemm`` picks the layer's kernel path from the
weights' dtype and ``torch.cpu._is_amx_tile_supported()``: the grouped-GEMM
kernels ("vec" without AMX, "amx" for bfloat16 with it), or, for float32 on a
host with AMX, plain torch (``forward_torch``). That torch path looks up its
activation in ``cpu_fused_moe._CPU_MOE_ACT_FN``, whose SiLU entry builds a
``SiluAndMul`` custom op on every call, during the forward pass, outside
vLLM's config context: ``AssertionError: Current vLLM config is not set``. The
embedded hybrid (Qwen3-Next, which needs one MoE layer) runs in float32, so on
any AMX host its engines die at their first forward (warm-up), before serving.

When ``VLLM_NIXL_HMA_CPU_MOE`` is set (``e2e`` sets it for every engine it
starts), the plugin entry point, which vLLM runs in every process:

* makes the SiLU entry ``SiluAndMul.forward_native``, the static method the
  lambda ends up calling: the same arithmetic, no custom op built (vLLM
  0.21.0's own comment above that table says it is meant to avoid exactly
  that);
* logs, once per layer kind, the path the layer took and what it was told
  about AMX (``PATH_MARK`` below), so that a run shows which kernels its
  engines used;
* with the value ``amx`` or ``no-amx``, makes ``check_grouped_gemm`` (and only
  it, for the length of the call) see that answer instead of the host's, so
  that either path can be run on any x86 host (``e2e --cpu-amx``). ``host``
  leaves the host's answer.

Unset, nothing is touched. Remove when: the supported vLLM CPU build builds no
custom op in ``forward_torch``.
"""

from __future__ import annotations

import contextlib
import os
import re

ENV = "VLLM_NIXL_HMA_CPU_MOE"
#: the values of ``$VLLM_NIXL_HMA_CPU_MOE``: what the MoE path choice is told about AMX
CHOICES = ("host", "amx", "no-amx")
_MARK = "_vllm_nixl_hma_cpu_moe"
#: the line each engine process logs when a MoE layer picks its path
PATH_MARK = "vllm_nixl_hma cpu_moe: fused-MoE path"
PATH_LINE = re.compile(re.escape(PATH_MARK) + r" (\S+) \(AMX (yes|no)(, forced)?; dtype (\w+)\)")
#: the path names in those lines: grouped GEMM with vLLM's "vec" or "amx" kernels, or torch
PATHS = ("grouped-gemm-vec", "grouped-gemm-amx", "torch")


def expected_path(amx: bool, dtype: str = "float32", grouped_gemm_kernels: bool = True) -> str:
    """The path vLLM 0.21.0's CPU fused-MoE layer takes for weights of
    ``dtype`` whose sizes are multiples of 32 (the embedded hybrid's are), on
    a host whose vLLM kernel library has (``grouped_gemm_kernels``) or lacks
    the grouped-GEMM MoE kernels."""
    if not grouped_gemm_kernels:
        return "torch"
    if not amx:
        return "grouped-gemm-vec"
    return "grouped-gemm-amx" if dtype == "bfloat16" else "torch"


def host_has_grouped_gemm_kernels() -> bool:
    """Whether the kernel library vLLM loads on this host has the grouped-GEMM
    MoE kernels (``prepack_moe_weight``): vLLM 0.21.0's CPU build loads an
    AVX-512 library that has them, or on a host without AVX-512 an AVX2 one
    that does not; without them the layer takes the torch path whatever the
    AMX answer."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return hasattr(torch.ops._C, "prepack_moe_weight")


def host_has_amx() -> bool:
    """Whether this host's CPU reports AMX tiles, as vLLM asks torch."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def apply_from_env() -> str | None:
    """Apply the substitution (idempotent); returns the value of
    ``$VLLM_NIXL_HMA_CPU_MOE``, or None when it is unset."""
    choice = os.environ.get(ENV)
    if not choice:
        return None
    if choice not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {choice!r}")
    try:
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe
    except ImportError:  # a vLLM without the CPU MoE layer: nothing to substitute
        return choice
    layer_cls = getattr(cpu_fused_moe, "CPUFusedMOE", None)
    if layer_cls is None or getattr(layer_cls, _MARK, None) == choice:
        return choice
    _use_static_silu(cpu_fused_moe)
    check = getattr(layer_cls.check_grouped_gemm, "__wrapped__", layer_cls.check_grouped_gemm)

    def check_grouped_gemm(self, layer):
        with _amx_answer(choice):
            use_grouped_gemm, isa = check(self, layer)
            amx = host_has_amx()
        path = f"grouped-gemm-{isa}" if use_grouped_gemm else "torch"
        dtype = str(layer.w13_weight.dtype).removeprefix("torch.")
        forced = ", forced" if choice != "host" else ""
        _logger().warning("%s %s (AMX %s%s; dtype %s)", PATH_MARK, path, _yes(amx), forced, dtype)
        return use_grouped_gemm, isa

    check_grouped_gemm.__wrapped__ = check
    layer_cls.check_grouped_gemm = check_grouped_gemm
    setattr(layer_cls, _MARK, choice)
    return choice


def _use_static_silu(cpu_fused_moe) -> None:
    """The SiLU entry of the torch path's activation table, without building
    a custom op per call."""
    table = getattr(cpu_fused_moe, "_CPU_MOE_ACT_FN", None)
    if table is None:
        return
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    table[MoEActivation.SILU] = SiluAndMul.forward_native


@contextlib.contextmanager
def _amx_answer(choice: str):
    """``torch.cpu._is_amx_tile_supported`` answers as ``choice`` says, inside."""
    import torch

    if choice == "host":
        yield
        return
    original = torch.cpu._is_amx_tile_supported
    torch.cpu._is_amx_tile_supported = lambda: choice == "amx"
    try:
        yield
    finally:
        torch.cpu._is_amx_tile_supported = original


def _logger():
    from vllm.logger import init_logger

    return init_logger(f"vllm.{__name__}")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def paths_in_log(text: str) -> list[tuple[str, bool, bool, str]]:
    """(path, AMX, forced, dtype) of every path line in an engine's log."""
    return [
        (path, amx == "yes", bool(forced), dtype)
        for path, amx, forced, dtype in PATH_LINE.findall(text)
    ]


def probe(dtype: str = "float32") -> str:
    """The path vLLM's CPU fused-MoE layer takes on this host for weights of
    ``dtype`` shaped like the embedded hybrid's MoE layer (hidden 128, expert
    intermediate 64), read off a real ``CPUFusedMOE``; with
    ``$VLLM_NIXL_HMA_CPU_MOE`` set, as the substitution makes it choose."""
    import torch
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import CPUFusedMOE

    apply_from_env()
    hidden, intermediate, experts = 128, 64, 2
    layer = torch.nn.Module()
    weights = {
        "w13_weight": (experts, 2 * intermediate, hidden),
        "w2_weight": (experts, hidden, intermediate),
    }
    for name, shape in weights.items():
        tensor = torch.zeros(shape, dtype=getattr(torch, dtype))
        setattr(layer, name, torch.nn.Parameter(tensor, requires_grad=False))
    moe = CPUFusedMOE(layer)
    return f"grouped-gemm-{moe.isa}" if moe.forward_method == moe.forward_grouped_gemm else "torch"


def main() -> None:
    """``python -m vllm_nixl_hma.e2e.cpu_moe``: one line, what this host's
    engines do with the embedded hybrid's float32 MoE layer (tools/test.sh
    prints it before the e2e tests)."""
    choice = os.environ.get(ENV, "host")
    told = "" if choice == "host" else f", told {choice}"
    kernels = "has" if host_has_grouped_gemm_kernels() else "lacks"
    print(
        f"cpu_moe: this host {'has' if host_has_amx() else 'lacks'} AMX{told}, its vLLM "
        f"kernel library {kernels} the grouped-GEMM MoE kernels; vLLM's CPU fused-MoE "
        f"layer takes the {probe()} path for the embedded hybrid (float32)"
    )


if __name__ == "__main__":
    main()
