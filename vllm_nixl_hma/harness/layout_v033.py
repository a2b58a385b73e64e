"""One TP rank's KV cache laid out as vLLM 0.33's GPU model runner lays it out, in CPU memory.

vLLM 0.33 replaced 0.21's per-layer tensors (``_allocate_kv_cache_tensors`` and
``_reshape_kv_cache_tensors``) with one int8 backing buffer that every
``KVCacheTensor`` places its layers in (``offset + layer * layer_stride + block *
block_stride``), viewed per layer as 4D ``[blocks, heads, tokens, C]`` where an
attention layer's ``C`` holds K then V and a Mamba layer's ``C`` holds its
states back to back. What decides the layout is vLLM's code, called in the
order ``EngineCore._initialize_kv_caches`` and ``GPUModelRunner.initialize_kv_cache``
call it:

* ``register_all_kvcache_specs``; ``resolve_kv_cache_layout`` with the layouts the
  backends support (it honours the connector's own request: NIXL asks for LBHNC)
  and writes the layout onto ``cache_config``, as the engine core does;
* ``get_global_kv_cache_groups`` and ``get_kv_cache_configs`` (the HMA groups and
  the shared tensors);
* ``prepare_kernel_block_sizes`` with one ``AttentionGroup`` per group;
* ``allocate_kv_cache``: the buffer and the views the runner hands to
  ``connector.register_kv_caches``;
* the Mamba layer's own ``bind_kv_cache`` splits a page into its conv and SSM
  state, as the runner's ``bind_kv_cache`` does.

The layer specs, the model shapes and the head and row mapping come from
``layout`` (shared with 0.21). The attention backend is FlashInfer's class,
as in ``layout`` (fixed kernel block sizes, so the kernel-per-logical ratio
exceeds 1 as on a GPU).
"""

from __future__ import annotations

import copy
import math
from typing import Any

from vllm_nixl_hma.harness import layout as common

__all__ = ["build_engine_layout"]


def _attention_group_backend(spec: Any, attention_backend: type) -> type:
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    if isinstance(spec, AttentionSpec):
        return attention_backend
    if isinstance(spec, MambaSpec):
        return spec.mamba_type.get_class()
    raise NotImplementedError(type(spec).__name__)


def page_regions(kv_cache_config: Any, buffer: Any) -> list[Any]:
    """Every layer's pages as an int8 ``[logical block, block_stride bytes]`` view of
    ``buffer``, once per distinct region (cache groups overlay each other)."""
    import torch

    regions = []
    seen: set[int] = set()
    num_blocks = kv_cache_config.num_blocks
    for tensor in kv_cache_config.kv_cache_tensors:
        for index in range(len(tensor.layers)):
            start = tensor.offset + index * tensor.layer_stride
            if start in seen:
                continue
            seen.add(start)
            regions.append(
                torch.as_strided(
                    buffer,
                    (num_blocks, tensor.block_stride),
                    (tensor.block_stride, 1),
                    buffer.storage_offset() + start,
                )
            )
    return regions


def build_engine_layout(vllm_config: Any, tp_rank: int) -> common.EngineLayout:
    """Allocate and shape TP rank ``tp_rank``'s KV cache in CPU memory, vLLM 0.33's way."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import (
        AttentionGroup,
        allocate_kv_cache,
        prepare_kernel_block_sizes,
    )

    cc = vllm_config.cache_config
    pc = vllm_config.parallel_config
    common._require(0 <= tp_rank < pc.tensor_parallel_size)
    if cc.num_gpu_blocks_override is None:
        raise ValueError("set cache_config.num_gpu_blocks_override (num_gpu_blocks)")

    layers = common.build_cache_layers(vllm_config)
    specs = common.build_kv_cache_specs(vllm_config, layers)
    attention_backend = common._attention_backend_cls()

    with set_current_vllm_config(vllm_config):
        register_all_kvcache_specs(vllm_config)
        backends = list(
            dict.fromkeys(_attention_group_backend(s, attention_backend) for s in specs.values())
        )
        supported = [[lay.name for lay in get_supported_kv_cache_layouts(backends)]]
        if cc.kv_cache_layout is None:  # the engine core resolves it once per engine
            resolve_kv_cache_layout(vllm_config, supported, list(specs.values()))
        layout_enum = cc.get_resolved_kv_cache_layout()
        global_groups = get_global_kv_cache_groups(vllm_config, [specs])
        # Any bytes figure: num_gpu_blocks_override decides the number of blocks.
        kv_cache_config = get_kv_cache_configs(vllm_config, [specs], [1 << 40], global_groups)[0]
        kv_cache_config.kv_cache_layout = cc.kv_cache_layout
        kv_cache_config = copy.deepcopy(kv_cache_config)  # as GPUModelRunner.initialize_kv_cache

        attn_groups = [
            [
                AttentionGroup(
                    _attention_group_backend(group.kv_cache_spec, attention_backend),
                    list(group.layer_names),
                    group.kv_cache_spec,
                    gid,
                )
            ]
            for gid, group in enumerate(kv_cache_config.kv_cache_groups)
        ]
        kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attn_groups)
        kv_caches = allocate_kv_cache(
            kv_cache_config, torch.device("cpu"), layout_enum, kernel_block_sizes
        )

    def attention_kv(name: str, spec: Any, gid: int, view: Any) -> Any:
        # [blocks, heads, tokens, K|V] -> [blocks, 2, heads, tokens, head_size]
        common._require(
            view.shape[-1] == spec.head_size + spec.head_size_v
            and spec.head_size == spec.head_size_v,
            (name, tuple(view.shape)),
        )
        return view.unflatten(-1, (2, spec.head_size)).permute(0, 3, 1, 2, 4)

    def mamba_states(name: str, view: Any) -> Any:
        layers[name].bind_kv_cache(view)  # the layer's own split of its page
        return layers[name].kv_cache

    attention, mamba, attn_kernel_sizes = common.layer_views(
        vllm_config,
        tp_rank,
        kv_cache_config,
        kv_caches,
        kernel_block_sizes,
        layers,
        specs,
        attention_kv,
        mamba_states,
    )
    # the manager's block: vLLM 0.33 may give the attention groups a block
    # larger than --block-size (two sliding-window/full groups sharing pages)
    attention_blocks = [
        g.kv_cache_spec.block_size
        for g in kv_cache_config.kv_cache_groups
        if isinstance(g.kv_cache_spec, AttentionSpec)
    ]
    logical = math.lcm(*attention_blocks) if attention_blocks else cc.block_size
    kernel = attn_kernel_sizes.pop() if attn_kernel_sizes else logical
    common._require(logical % kernel == 0, (logical, kernel_block_sizes))
    regions = []
    if kv_caches:  # every view shares one backing buffer
        storage = next(iter(kv_caches.values())).untyped_storage()
        regions = page_regions(kv_cache_config, torch.empty(0, dtype=torch.int8).set_(storage))
    return common.EngineLayout(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        kv_caches=kv_caches,
        attention=attention,
        mamba=mamba,
        logical_block_tokens=logical,
        kernel_block_tokens=kernel,
        physical_per_logical=logical // kernel,
        tp_rank=tp_rank,
        tp_size=pc.tensor_parallel_size,
        kernel_block_sizes=list(kernel_block_sizes),
        kv_cache_layout=layout_enum.name,
        page_regions=regions,
    )
