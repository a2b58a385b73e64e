"""The e2e substitution for vLLM's CPU fused-MoE layer (``e2e/cpu_moe.py``),
on vLLM's CPU build: both kernel paths computed by vLLM's own layer on this
host, against the same MoE computed here by hand.

On a host with AMX a float32 MoE layer takes vLLM's plain-torch path, whose
SiLU builds a custom op outside vLLM's config context and raises (the
embedded hybrid's engines died at start there); elsewhere it takes the
grouped-GEMM kernels. ``VLLM_NIXL_HMA_CPU_MOE=amx`` / ``no-amx`` makes the
layer choose as on the other kind of host, so both paths run on any x86 host.
Each case runs in its own process: the substitution patches vLLM's classes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.e2e

LAYER = """
    import json
    import torch
    import torch.nn.functional as F
    from vllm_nixl_hma import plugin
    plugin.register()
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import CPUFusedMOE

    torch.manual_seed(0)
    experts, hidden, inter, tokens = 2, 128, 64, 7  # the embedded hybrid's MoE sizes
    layer = torch.nn.Module()
    w13 = torch.randn(experts, 2 * inter, hidden) * 0.1
    w2 = torch.randn(experts, hidden, inter) * 0.1
    layer.w13_weight = torch.nn.Parameter(w13.clone(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(w2.clone(), requires_grad=False)
    x = torch.randn(tokens, hidden)
    logits = torch.randn(tokens, experts)
    moe = CPUFusedMOE(layer)
    path = "torch" if moe.forward_method == moe.forward_torch else f"grouped-gemm-{moe.isa}"
    out = moe(layer, x.clone(), False, 1, logits, True, global_num_experts=experts,
              activation=MoEActivation.SILU)
    # by hand: top-1 routing (its renormalized weight is 1), SiLU(gate) * up, down
    rows = []
    for t in range(tokens):
        e = int(logits[t].argmax())
        gate_up = w13[e] @ x[t]
        rows.append(w2[e] @ (F.silu(gate_up[:inter]) * gate_up[inter:]))
    error = float((out - torch.stack(rows)).abs().max())
    print(json.dumps({"path": path, "max_error": error, "scale": float(out.abs().max())}))
"""

UPSTREAM_SILU = """
    import json
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import _CPU_MOE_ACT_FN
    try:
        _CPU_MOE_ACT_FN[MoEActivation.SILU](torch.randn(3, 8))
        print(json.dumps({"raised": None}))
    except Exception as e:
        print(json.dumps({"raised": type(e).__name__, "message": str(e)[:200]}))
"""


def run(script: str, choice: str | None) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_NIXL_HMA_CPU_MOE"}
    if choice is not None:
        env["VLLM_NIXL_HMA_CPU_MOE"] = choice
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # vLLM logs to stdout: the log is both streams
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout + done.stderr


def host_amx() -> bool:
    from vllm_nixl_hma.e2e import cpu_moe

    return cpu_moe.host_has_amx()


def host_kernels() -> bool:
    from vllm_nixl_hma.e2e import cpu_moe

    return cpu_moe.host_has_grouped_gemm_kernels()


@pytest.mark.parametrize("choice", ["amx", "no-amx"])
def test_each_path_computes_the_moe_layer_right_on_this_host(choice):
    """Told AMX, float32 takes the torch path; told no AMX, the vec grouped
    GEMM where this host's vLLM library has it (AVX-512), else torch again."""
    from vllm_nixl_hma.e2e import cpu_moe

    path = "grouped-gemm-vec" if choice == "no-amx" and host_kernels() else "torch"
    seen, log = run(LAYER, choice)
    assert seen["path"] == path
    assert seen["scale"] > 0.01  # not a layer of zeros
    assert seen["max_error"] < 1e-4 * seen["scale"], seen
    # the engine log says which path, and that it was forced
    assert (path, choice == "amx", True, "float32") in cpu_moe.paths_in_log(log), log[-2000:]


def test_told_the_truth_the_layer_takes_the_hosts_path():
    from vllm_nixl_hma.e2e import cpu_moe

    seen, log = run(LAYER, "host")
    assert seen["path"] == cpu_moe.expected_path(host_amx(), grouped_gemm_kernels=host_kernels())
    assert seen["max_error"] < 1e-4 * seen["scale"], seen
    assert cpu_moe.paths_in_log(log) == [(seen["path"], host_amx(), False, "float32")]


def test_upstream_silu_of_the_torch_path_still_needs_the_substitution():
    """vLLM 0.21.0's own table entry, untouched: it builds a custom op outside
    vLLM's config context and raises. When this stops raising, the SiLU part
    of ``cpu_moe`` can go."""
    seen, _ = run(UPSTREAM_SILU, None)
    assert seen["raised"] == "AssertionError", seen
    assert "config is not set" in seen["message"]
