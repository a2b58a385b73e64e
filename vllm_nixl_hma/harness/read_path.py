"""A decode worker ready to run its read path, without an engine (tests, benchmarks).

``build_read_path_worker`` returns a real ``NixlConnectorWorker`` (or our
subclass) with the state that ``register_kv_caches`` and ``add_remote_agent``
would have set for a decode TP 1 that handshook with a prefill TP 1: real vLLM
KV cache specs, transfer topology and TP mapping. Only the NIXL agent is the
caller's (a recording fake in the unit tests and the read-path benchmark).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

LOCAL_ENGINE = "decode-engine"
REMOTE_ENGINE = "prefill-engine"
LOCAL_XFER_HANDLE = 101
REMOTE_XFER_HANDLE = 202
MAMBA = "mamba"
SWA = "sliding_window"


def kv_cache_config(
    group_kinds: list[str],
    physical_per_logical: int,
    logical_blocks: int,
    kernel_block_tokens: int,
    window_tokens: int,
):
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
        SlidingWindowSpec,
    )

    logical_block_tokens = physical_per_logical * kernel_block_tokens
    groups = []
    for index, kind in enumerate(group_kinds):
        if kind == MAMBA:
            spec = MambaSpec(
                shapes=((8, 4), (2, 8, 4)),
                dtypes=(torch.bfloat16, torch.bfloat16),
                block_size=1 << 20,
            )
        elif kind == SWA:
            spec = SlidingWindowSpec(
                block_size=logical_block_tokens,
                num_kv_heads=1,
                head_size=8,
                dtype=torch.bfloat16,
                sliding_window=window_tokens,
            )
        else:
            spec = FullAttentionSpec(
                block_size=logical_block_tokens, num_kv_heads=1, head_size=8, dtype=torch.bfloat16
            )
        groups.append(KVCacheGroupSpec(layer_names=[f"layers.{index}"], kv_cache_spec=spec))
    tensors = [KVCacheTensor(size=1 << 20, shared_by=[g.layer_names[0] for g in groups])]
    return KVCacheConfig(
        num_blocks=logical_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    )


def build_read_path_worker(
    worker_cls: type,
    group_kinds: list[str],
    local_ratio: int,
    remote_ratio: int,
    nixl_wrapper: Any,
    *,
    logical_blocks: int,
    kernel_block_tokens: int = 16,
    window_tokens: int = 40,
    num_regions: int = 2,
):
    from vllm.distributed.kv_transfer.kv_connector.utils import (
        EngineTransferInfo,
        TransferTopology,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend

    worker = object.__new__(worker_cls)
    config = kv_cache_config(
        group_kinds, local_ratio, logical_blocks, kernel_block_tokens, window_tokens
    )
    has_mamba = MAMBA in group_kinds
    worker.kv_cache_config = config
    worker._group_spec_types = tuple(type(g.kv_cache_spec) for g in config.kv_cache_groups)
    worker._physical_blocks_per_logical_kv_block = local_ratio
    worker.block_size = kernel_block_tokens
    worker._has_mamba = has_mamba
    worker._is_hma_required = len(group_kinds) > 1
    worker.use_mla = False
    worker.engine_id = LOCAL_ENGINE
    worker.tp_rank = 0
    worker.world_size = 1
    worker.num_regions = num_regions
    worker.block_len_per_layer = [1024] * num_regions
    worker.transfer_topo = TransferTopology(
        tp_rank=0,
        tp_size=1,
        block_size=kernel_block_tokens,
        engine_id=LOCAL_ENGINE,
        is_mla=False,
        is_mamba=has_mamba,
        total_num_kv_heads=1,
        attn_backends=[FlashInferBackend],
    )
    worker.transfer_topo.register_remote_engine(
        REMOTE_ENGINE,
        EngineTransferInfo(
            remote_tp_size=1,
            remote_block_len=1024,
            remote_block_size=kernel_block_tokens,
            remote_physical_blocks_per_logical=remote_ratio,
        ),
    )
    worker.tp_mappings = {
        REMOTE_ENGINE: compute_tp_mapping(worker.transfer_topo, 1, worker._group_spec_types)
    }
    worker.dst_num_blocks = {
        LOCAL_ENGINE: logical_blocks * local_ratio,
        REMOTE_ENGINE: logical_blocks * remote_ratio,
    }
    worker.src_xfer_handles_by_block_size = {kernel_block_tokens: LOCAL_XFER_HANDLE}
    worker.src_xfer_handles_by_tp_ratio = {}
    worker.dst_xfer_side_handles = {REMOTE_ENGINE: {0: REMOTE_XFER_HANDLE}}
    worker._remote_agents = {REMOTE_ENGINE: {0: "prefill-agent-0"}}
    worker.nixl_wrapper = nixl_wrapper
    worker._recving_transfers = defaultdict(list)
    worker._recving_metadata = {}
    worker._invalid_block_ids = set()
    worker._failed_recv_reqs = set()
    worker.xfer_stats = NixlKVConnectorStats()
    return worker
