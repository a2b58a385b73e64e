"""The e2e substitution that keeps vLLM's CPU NIXL worker off one reserved core."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = """
    import json
    from vllm.platforms.cpu import CpuPlatform
    before = CpuPlatform.discover_numa_topology()
    from vllm_nixl_hma import plugin
    plugin.register()
    plugin.register()  # vLLM calls it several times per process
    print(json.dumps({"before": before, "after": CpuPlatform.discover_numa_topology()}))
"""


def topology(flag: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
        env={**os.environ, "VLLM_NIXL_HMA_CPU_NO_KV_CORE": flag},
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_with_the_variable_no_core_is_reserved_for_kv():
    seen = topology("1")
    assert seen["before"] and all(seen["before"])  # what the NIXL worker would pin to
    assert seen["after"] == []  # its reservation list comes out empty: nothing pinned


def test_without_the_variable_nothing_is_touched():
    seen = topology("")
    assert seen["after"] == seen["before"] != []


def test_every_e2e_engine_asks_for_it():
    from vllm_nixl_hma.e2e.servers import EngineSpec

    for connector in (None, "NixlHMAConnector", "NixlConnector"):
        env = EngineSpec("x", "/m", 1, connector=connector).environment()
        assert env["VLLM_NIXL_HMA_CPU_NO_KV_CORE"] == "1"
