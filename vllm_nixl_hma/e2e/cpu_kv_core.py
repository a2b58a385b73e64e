"""The second substitution ``vllm-nixl-hma e2e`` makes in the engines it starts.

On a CPU platform, vLLM 0.21.0's NIXL worker pins the thread that builds it to
the last core of each NUMA node ("reserve different cores for start_load_kv()
from model_forward()", ``NixlConnectorWorker.__init__``). That thread is the
worker's main thread, which on CPU also runs the model, and every thread it
starts later inherits the pin: the handshake thread, ZMQ's and UCX's I/O
threads. On a server with many cores, model threads are bound elsewhere. On a
small host running several engines, every worker of every engine, prefill and
decode, lands on the same one core, beside worker main threads that busy-poll
while a request waits for its KV: there a decode engine's first side-channel
query took 53 s to leave its process (measured on this project's 2-core CI
host, a prefill TP 2 and a decode TP 1 engine), and stock's fixed 5 s
handshake timeout failed the request and crashed the engine.

When ``VLLM_NIXL_HMA_CPU_NO_KV_CORE`` is set (``e2e`` sets it for every
engine it starts), the plugin entry point makes ``CpuPlatform`` report no NUMA
topology (its only caller is that reservation), so no core is reserved and threads keep the
process's affinity. Both connectors' engines get it (the plugin runs in every
vLLM process). Unset, nothing is touched.
"""

from __future__ import annotations

import os

ENV = "VLLM_NIXL_HMA_CPU_NO_KV_CORE"
_MARK = "_vllm_nixl_hma_no_kv_core"


def apply_from_env() -> bool:
    """Stop the NIXL worker's core reservation on CPU (idempotent); returns
    whether ``$VLLM_NIXL_HMA_CPU_NO_KV_CORE`` asked for it."""
    if not os.environ.get(ENV):
        return False
    from vllm.platforms.cpu import CpuPlatform

    if not getattr(CpuPlatform, _MARK, False):
        # discover_numa_topology's only caller in vLLM 0.21.0 is that reservation
        CpuPlatform.discover_numa_topology = classmethod(lambda cls: [])
        setattr(CpuPlatform, _MARK, True)
    return True
