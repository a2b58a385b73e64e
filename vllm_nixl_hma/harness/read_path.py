"""A decode worker ready to run its read path, without an engine (tests, benchmarks).

``build_read_path_worker`` returns a real ``NixlConnectorWorker`` (or our
subclass) with the state that ``register_kv_caches`` and ``add_remote_agent``
would have set for a decode TP 1 that handshook with a prefill TP 1: real vLLM
KV cache specs, transfer topology and TP mapping. Only the NIXL agent is the
caller's (a recording fake in the unit tests and the read-path benchmark).
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from dataclasses import dataclass
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
    with_remote: bool = True,
):
    from vllm.distributed.kv_transfer.kv_connector.utils import (
        EngineTransferInfo,
        TransferTopology,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend

    from vllm_nixl_hma.v021.worker import FailedRequests, NixlHMAConnectorWorker

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
    worker.tp_mappings = {}
    worker.dst_num_blocks = {LOCAL_ENGINE: logical_blocks * local_ratio}
    worker.src_xfer_handles_by_block_size = {}
    worker.src_xfer_handles_by_tp_ratio = {}
    worker.dst_xfer_side_handles = defaultdict(dict)
    worker._remote_agents = defaultdict(dict)
    if with_remote:  # as add_remote_agent leaves it, with made-up handles
        worker.transfer_topo.register_remote_engine(
            REMOTE_ENGINE,
            EngineTransferInfo(
                remote_tp_size=1,
                remote_block_len=1024,
                remote_block_size=kernel_block_tokens,
                remote_physical_blocks_per_logical=remote_ratio,
            ),
        )
        worker.tp_mappings[REMOTE_ENGINE] = compute_tp_mapping(
            worker.transfer_topo, 1, worker._group_spec_types
        )
        worker.dst_num_blocks[REMOTE_ENGINE] = logical_blocks * remote_ratio
        worker.src_xfer_handles_by_block_size[kernel_block_tokens] = LOCAL_XFER_HANDLE
        worker.dst_xfer_side_handles[REMOTE_ENGINE][0] = REMOTE_XFER_HANDLE
        worker._remote_agents[REMOTE_ENGINE][0] = "prefill-agent-0"
    worker.nixl_wrapper = nixl_wrapper
    worker._recving_transfers = defaultdict(list)
    worker._recving_metadata = {}
    worker._invalid_block_ids = set()
    worker._failed_recv_reqs = (
        FailedRequests() if issubclass(worker_cls, NixlHMAConnectorWorker) else set()
    )
    worker.xfer_stats = NixlKVConnectorStats()
    return worker


# ------------------------------------------------------------------ live NIXL

#: Mamba2 state of the live read path: conv (x 8 + B 4 + C 4 channels, 3 rows)
#: and SSM (2 heads x 4 x 4), bf16: 96 + 64 bytes in a page of at least 160.
LIVE_MAMBA_SHAPES = ((16, 3), (2, 4, 4))
LIVE_KV_LAYOUT = "HND"


@dataclass
class LiveReadPath:
    """A decode worker and a prefill NIXL agent in one process, with DRAM
    caches registered on both and the prefill rank added the way a handshake
    adds it (``add_remote_agent``). Reads move real bytes over UCX."""

    worker: Any
    prefill_agent: Any
    local_caches: list  # per layer, uint8 (kernel pages x page bytes)
    remote_caches: list
    registrations: list  # (agent, registered descriptors)

    def meta(self, request_id: str, local_ids=(), remote_ids=()) -> Any:
        """vLLM's ``ReqMeta`` of a request read from the prefill rank here
        (logical ids per group on each side; none: as decode holds it once read)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            RemoteMeta,
            ReqMeta,
        )

        return ReqMeta(
            local_block_ids=list(local_ids),
            local_physical_block_ids=self.worker._logical_to_kernel_block_ids(list(local_ids)),
            tp_size=1,
            remote=RemoteMeta(
                block_ids=list(remote_ids),
                host="127.0.0.1",
                port=1,
                engine_id=REMOTE_ENGINE,
                request_id=f"prefill-{request_id}",
            ),
        )

    def read(self, request_id: str, local_ids, remote_ids) -> None:
        """Decode's read path for one request (logical ids per group on each
        side), from metadata to the posted transfer."""
        self.worker._read_blocks_for_req(request_id, self.meta(request_id, local_ids, remote_ids))

    def wait(self, request_id: str, timeout_s: float = 60.0) -> None:
        """Wait for the request's reads, then release them."""
        handles = self.worker._recving_transfers.pop(request_id, [])
        deadline = time.monotonic() + timeout_s
        for handle in handles:
            while (state := self.worker.nixl_wrapper.check_xfer_state(handle)) == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"read of {request_id} still in flight after {timeout_s} s")
            self.worker.nixl_wrapper.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"read of {request_id} ended {state}")
        self.prefill_agent.get_new_notifs()

    def close(self) -> None:
        """Release everything and drop both agents (their UCX threads stop
        when the agents are collected)."""
        self.worker.shutdown()
        for agent, descs in self.registrations:
            agent.deregister_memory(descs)
        self.registrations.clear()
        self.worker.nixl_wrapper = None
        self.prefill_agent = None
        gc.collect()


def build_live_read_path(
    worker_cls: type,
    group_kinds: list[str],
    physical_per_logical: int,
    *,
    layers: int,
    logical_blocks: int,
    page_bytes: int = 256,
    kernel_block_tokens: int = 16,
    mamba_shapes: tuple = LIVE_MAMBA_SHAPES,
    nixl_threads: int = 4,
    progress_delay_us: int | None = None,
) -> LiveReadPath:
    """Decode TP 1 reading prefill TP 1, both with ``physical_per_logical``
    kernel blocks per logical block and ``layers`` layers of
    ``logical_blocks * physical_per_logical`` kernel pages of ``page_bytes``.
    The worker's state is what ``register_kv_caches`` would set (FlashInfer's
    blocks-first layout: K and V halves of each page are separate
    descriptors); the prefill rank is added with vLLM's ``add_remote_agent``.
    ``nixl_threads`` is vLLM's ``num_threads`` (its default: 4). Each
    worker's agent is configured as that worker's constructor configures it
    (ours: ``worker.build_nixl_agent`` with our default split); prefill's as
    upstream's (the reader's configuration alone decides how a READ is split).
    ``progress_delay_us``: both agents' progress threads wait that long
    between polls (``core.progress_thread``); None: NIXL's own, no wait.
    """
    import types
    import uuid

    import torch
    from nixl._api import nixl_agent, nixl_agent_config
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import (
        derive_mamba_conv_split,
    )
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_nixl_hma.core.progress_thread import agents_built_with_delay
    from vllm_nixl_hma.core.read_threads import DEFAULT_SPLIT_BATCH_SIZE
    from vllm_nixl_hma.v021.worker import (
        NixlHMAConnectorWorker,
        build_nixl_agent,
        derive_state_split,
    )

    # as vLLM 0.21.0 configures its agents with UCX alone, telemetry captured
    # (its _pop_done_transfers reads each finished read's telemetry)
    config = nixl_agent_config(num_threads=nixl_threads, capture_telemetry=True)
    decode_name = f"decode-{uuid.uuid4()}"
    if issubclass(worker_cls, NixlHMAConnectorWorker):
        decode_agent = build_nixl_agent(
            nixl_agent, decode_name, config, DEFAULT_SPLIT_BATCH_SIZE, progress_delay_us
        )
    else:
        with agents_built_with_delay(nixl_agent, progress_delay_us):
            decode_agent = nixl_agent(decode_name, config)
    with agents_built_with_delay(nixl_agent, progress_delay_us):
        prefill_agent = nixl_agent(f"prefill-{uuid.uuid4()}", config)
    worker = build_read_path_worker(
        worker_cls,
        group_kinds,
        physical_per_logical,
        physical_per_logical,
        decode_agent,
        logical_blocks=logical_blocks,
        kernel_block_tokens=kernel_block_tokens,
        num_regions=2 * layers,  # blocks-first: K and V of each layer
        with_remote=False,  # added below by add_remote_agent
    )
    kernel_blocks = logical_blocks * physical_per_logical
    local_caches = [
        torch.zeros(kernel_blocks * page_bytes, dtype=torch.uint8) for _ in range(layers)
    ]
    remote_caches = [torch.zeros_like(t) for t in local_caches]
    registrations = [
        (agent, agent.register_memory(agent.get_reg_descs(caches)))
        for agent, caches in ((decode_agent, local_caches), (prefill_agent, remote_caches))
    ]
    worker.block_len_per_layer = [page_bytes] * layers
    worker.num_blocks = kernel_blocks
    worker._logical_num_blocks = logical_blocks
    worker.device_id = 0
    worker.nixl_memory_type = "DRAM"
    worker.use_host_buffer = False
    worker.kv_cache_layout = LIVE_KV_LAYOUT
    worker.backend_name = "FLASHINFER"
    worker.kv_caches_base_addr = defaultdict(dict)
    worker.kv_caches_base_addr[LOCAL_ENGINE][0] = [t.data_ptr() for t in local_caches]
    worker._registered_descs = []
    worker._handshake_initiation_executor = types.SimpleNamespace(shutdown=lambda wait: None)
    # a Mamba2 mixer (one group) whose state has ``mamba_shapes`` at TP 1
    (conv_channels, _), (ssm_heads, ssm_head_dim, _) = mamba_shapes
    mamba_config = types.SimpleNamespace(
        mamba_n_heads=ssm_heads,
        mamba_d_head=ssm_head_dim,
        mamba_n_groups=1,
        mamba_d_state=(conv_channels - ssm_heads * ssm_head_dim) // 2,
    )
    worker.vllm_config = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(enable_prefix_caching=False),
        model_config=types.SimpleNamespace(
            hf_config=mamba_config, hf_text_config=mamba_config, architecture="BambaForCausalLM"
        ),
    )
    worker.kv_transfer_config = types.SimpleNamespace(enable_permute_local_kv=False)
    ssm_sizes = (0, 0)
    if worker._has_mamba:
        spec = MambaSpec(
            shapes=mamba_shapes,
            dtypes=(torch.bfloat16, torch.bfloat16),
            block_size=1 << 20,
            mamba_type=MambaAttentionBackendEnum.MAMBA2,
        )
        if isinstance(worker, NixlHMAConnectorWorker):
            worker._conv_decomp = derive_state_split(worker.vllm_config, spec, 1, 0)
        else:
            worker._conv_decomp = derive_mamba_conv_split(spec, 1)
        ssm_sizes = tuple(worker._conv_decomp.ssm_sizes)
        worker._mamba_ssm_size = ssm_sizes
    worker.num_descs = worker.num_regions * kernel_blocks
    worker.src_xfer_handles_by_block_size[kernel_block_tokens], worker.src_blocks_data = (
        worker.register_local_xfer_handler(kernel_block_tokens)
    )
    worker.add_remote_agent(
        NixlAgentMetadata(
            engine_id=REMOTE_ENGINE,
            agent_metadata=prefill_agent.get_agent_metadata(),
            kv_caches_base_addr=[t.data_ptr() for t in remote_caches],
            device_id=0,
            num_blocks=kernel_blocks,
            block_lens=[page_bytes] * layers,
            kv_cache_layout=LIVE_KV_LAYOUT,
            block_size=kernel_block_tokens,
            ssm_sizes=ssm_sizes,
            attn_backend_name="FLASHINFER",
            physical_blocks_per_logical_kv_block=physical_per_logical,
        ),
        0,
        1,
    )
    return LiveReadPath(worker, prefill_agent, local_caches, remote_caches, registrations)
