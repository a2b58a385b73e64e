"""The e2e substitution: the CPU attention backend's kernel block, fixed by env var."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(script: str, **env: str) -> str:
    import os

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
        env={**os.environ, **env},
    ).stdout


SCRIPT = """
    from vllm.v1.attention.backends import cpu_attn
    seen = []
    cpu_attn._get_attn_isa = lambda dtype, block_size, *a, **k: seen.append(block_size) or "x"
    original = cpu_attn.CPUAttentionBackend.get_supported_kernel_block_sizes
    from vllm_nixl_hma import plugin
    plugin.register()
    plugin.register()  # vLLM calls it several times per process
    now = cpu_attn.CPUAttentionBackend.get_supported_kernel_block_sizes
    after = now()
    cpu_attn._get_attn_isa("float32", 128, 32)
    print("unchanged", now is original)
    print("after", after)
    print("isa asked for", seen)
"""


def test_the_plugin_fixes_the_kernel_block_and_the_isa_follows_it():
    out = run(SCRIPT, VLLM_NIXL_HMA_CPU_KERNEL_BLOCK="16")
    assert "after [16]" in out and "unchanged False" in out
    assert "isa asked for [16]" in out  # the 128-token logical block is not what it sees


def test_without_the_variable_nothing_is_touched():
    out = run(SCRIPT, VLLM_NIXL_HMA_CPU_KERNEL_BLOCK="")
    assert "unchanged True" in out
    assert "isa asked for [128]" in out
