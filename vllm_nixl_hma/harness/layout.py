"""One TP rank's KV cache, laid out exactly as vLLM 0.21.0's GPU model runner does, in CPU memory.

Everything that decides the layout is vLLM's own code:

* the model class (resolved through ``ModelRegistry``) built on the meta device in this rank's TP
  group: every layer that holds a cache answers ``get_kv_cache_spec`` itself, as
  ``GPUModelRunner.get_kv_cache_spec`` asks it to, so layer names, kinds (full attention, sliding
  window, Mamba2, GatedDeltaNet, ...), shapes and dtypes are vLLM's, for any architecture vLLM
  builds; caches the connector does not move (MLA, Mamba1, short conv, ...) are refused with one
  line naming the architecture and the layer (``UnsupportedArchitecture``);
* ``Platform.update_block_size_for_backend`` (phase 1: the backend's preferred block size;
  phase 2: ``Platform._align_hybrid_block_size``) sets the hybrid logical block size and the
  padded Mamba page size, as every GPU worker does right after it starts
  (``vllm/v1/executor/*_executor.py``);
* ``vllm.v1.core.kv_cache_utils.get_kv_cache_configs`` builds the ``KVCacheConfig`` (HMA groups and
  the tensors that attention and Mamba layers share);
* ``vllm.v1.worker.utils.prepare_kernel_block_sizes`` (-> ``select_common_block_size``) picks the
  kernel block size per group;
* ``GPUModelRunner._allocate_kv_cache_tensors``, ``_reshape_kv_cache_tensors`` (which calls
  ``_update_hybrid_attention_mamba_layout`` for hybrids) allocate the shared int8 buffers and make
  the per-layer tensors that the runner hands to ``connector.register_kv_caches``.

Substitutions (kept narrow; each undone or local to this module):

1. While the model's layers are built, vLLM modules holding the platform object of this GPU-less
   host (vLLM 0.21.0's CUDA wheel reports an "unspecified" platform) see vLLM's ``CpuPlatform``
   instead (``_CpuPlatformForModelCode``): layers ask it for a device and an attention backend.
   Nothing is computed on it; the specs do not depend on its answers.
2. The attention backend is FlashInfer's class (``FlashInferBackend``; fixed kernel block sizes
   16/32/64) wherever vLLM would look one up for the KV layout: in the platform's
   ``_find_non_ssm_backend`` (via a private ``Platform`` subclass) and in the attention groups
   handed to the runner methods. Mamba-type groups get their ``mamba_type``'s backend class.
3. The runner is a small stand-in object with the attributes those methods read
   (``kv_cache_config``, ``attn_groups``, ``runner_only_attn_layers``, ``cache_config``,
   ``device="cpu"``); the methods are ``GPUModelRunner``'s own functions.
4. ``build_vllm_config`` sets ``scheduler_config.disable_hybrid_kv_cache_manager = False`` after
   building (vLLM forces it True on this CPU-only "unspecified" platform), or True with
   ``hma=False`` (what vLLM 0.21.0 chooses for a non-Mamba model with a KV connector).
5. The KV cache layout (``get_kv_cache_layout``, lru-cached process-wide) is recomputed inside
   ``set_current_vllm_config(cfg)`` so the connector's required layout (HND for NIXL) applies,
   as in a GPU worker; the cached value is left in place for the connector worker to read.
6. ``trust_remote_code`` is turned on when ``config.json`` has an ``auto_map``: vLLM 0.21.0 and
   transformers 4.57 register no ``nemotron_h`` config type, so a Nemotron-H config ships a
   ``configuration_nemotron_h.py`` (as real Nemotron-H checkpoints do).

Building the layers needs vLLM's TP group of the engine's TP size in the process (a rank process
of the check has one; ``single_process_tp_group`` makes one of size 1).

Head mapping (``AttentionLayerView.global_heads``) is the one rule written here rather than
called: it restates ``QKVParallelLinear``'s KV shard rule (``vllm/model_executor/layers/
linear.py``: ``shard_rank = tp_rank // num_kv_head_replicas``).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from dataclasses import dataclass, field  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "AttentionLayerView",
    "EngineLayout",
    "LayoutError",
    "MambaLayerView",
    "build_engine_layout",
    "build_vllm_config",
    "layer_plan",
    "verify_layout",
]


class LayoutError(AssertionError):
    """The built layout is not what vLLM's runner would make (or a check of it failed)."""


def _require(condition: object, *detail: object) -> None:
    if not condition:
        raise LayoutError(*detail)


# --------------------------------------------------------------------------- config


def _attention_backend_cls() -> type:
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend

    return FlashInferBackend


def _platform_cls() -> type:
    """A ``Platform`` whose attention-backend lookup answers FlashInfer (substitution 2)."""
    from vllm.platforms.interface import Platform

    class _HarnessPlatform(Platform):
        @classmethod
        def _find_non_ssm_backend(cls, vllm_config):  # noqa: ARG003 (vLLM 0.21)
            return _attention_backend_cls()

        @classmethod
        def _find_non_ssm_backends(cls, vllm_config):  # noqa: ARG003 (vLLM 0.33)
            return [_attention_backend_cls()]

    return _HarnessPlatform


def build_vllm_config(
    model_dir: str,
    tp_size: int,
    connector: str,
    engine_id: str,
    kv_role: str,
    num_gpu_blocks: int,
    max_model_len: int,
    enable_prefix_caching: bool = False,
    trust_remote_code: bool | None = None,
    device: str = "cpu",
    block_size: int | None = None,
    hma: bool = True,
    mamba_prefix_caching: bool | None = None,
    mamba_cache_mode: str | None = None,
) -> VllmConfig:
    """A ``VllmConfig`` for one engine of TP ``tp_size``, with the block sizes a GPU worker sets.

    ``trust_remote_code=None`` means: True exactly when ``config.json`` has an ``auto_map`` (the
    way Nemotron-H checkpoints ship their config class; transformers 4.57 lacks ``nemotron_h``).
    """
    import json

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if trust_remote_code is None:
        with open(os.path.join(str(model_dir), "config.json")) as f:
            trust_remote_code = "auto_map" in json.load(f)
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    if connector == "NixlHMAConnector":
        from vllm_nixl_hma import plugin

        plugin.register()

    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        trust_remote_code=trust_remote_code,
    )
    cfg = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(
            num_gpu_blocks_override=num_gpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
            # None: vLLM's (and the config hook's) choice; "all", "align": --mamba-cache-mode
            **({"mamba_cache_mode": mamba_cache_mode} if mamba_cache_mode is not None else {}),
            # None: the backend's choice; a number: --block-size
            **({"block_size": block_size} if block_size is not None else {}),
        ),
        device_config=DeviceConfig(device),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        scheduler_config=SchedulerConfig.default_factory(max_model_len=max_model_len),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_role=kv_role,
            engine_id=engine_id,
            kv_buffer_device=device,
            # the operator's word on a Mamba hybrid's prefix caching (None: unset)
            kv_connector_extra_config={}
            if mamba_prefix_caching is None
            else {"mamba_prefix_caching": mamba_prefix_caching},
        ),
    )
    # Substitution 4: CPU forces HMA off; the GPU engines we stand in for run with it
    # on (``hma=False``: as vLLM 0.21.0 runs a non-Mamba model with a connector).
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = not hma
    # What every GPU worker does right after it starts (substitution 2 for the backend).
    _platform_cls().update_block_size_for_backend(cfg)
    return cfg


# --------------------------------------------------------------------------- layer specs


@dataclass(frozen=True)
class LayerPlan:
    layer_index: int
    kind: str  # "attention", "sliding" or "mamba"
    layer_name: str


#: ``MambaSpec.mamba_type`` names whose state the connector (``mamba_conv``) moves
SUPPORTED_MAMBA_TYPES = ("MAMBA2", "GDN_ATTN")


class UnsupportedArchitecture(LayoutError):
    """The model's cache is of a kind the check (and the connector) does not move."""


def _model_cls(vllm_config: VllmConfig):
    from vllm.model_executor.models import ModelRegistry

    mc = vllm_config.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    return model_cls


class _CpuPlatformForModelCode:
    """Substitution 1: while the model's layers are built, vLLM modules that
    hold the (unspecified, CPU-only host) platform object see vLLM's CPU
    platform instead, which answers ``current_device()`` and attention-backend
    questions the way a CPU engine does; restored on exit."""

    def __enter__(self):
        import sys

        import vllm.platforms
        from vllm.platforms.cpu import CpuPlatform

        self._original = vllm.platforms.current_platform
        substitute = CpuPlatform()
        self._modules = [
            module
            for name, module in list(sys.modules.items())
            if name.startswith("vllm")
            and getattr(module, "current_platform", None) is self._original
        ]
        for module in self._modules:
            module.current_platform = substitute
        vllm.platforms._current_platform = substitute
        return self

    def __exit__(self, *exc_info):
        import vllm.platforms

        for module in self._modules:
            module.current_platform = self._original
        vllm.platforms._current_platform = self._original
        return False


def _require_tp_group(vllm_config: VllmConfig) -> None:
    """The model's layers read their TP size and rank from vLLM's TP group."""
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_world_size,
        model_parallel_is_initialized,
    )

    tp_size = vllm_config.parallel_config.tensor_parallel_size
    if not model_parallel_is_initialized() or get_tensor_model_parallel_world_size() != tp_size:
        raise LayoutError(
            f"building a TP {tp_size} layout needs vLLM's TP group of that size "
            "(init_distributed_environment + initialize_model_parallel) in this process"
        )


def build_cache_layers(vllm_config: VllmConfig) -> dict[str, Any]:
    """layer name -> the model's layer that holds a cache, built the way the GPU runner
    builds the model, but on the meta device (no weights, no memory) in this rank's TP group."""
    import torch
    from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.utils.torch_utils import set_default_torch_dtype

    _require_tp_group(vllm_config)
    model_cls = _model_cls(vllm_config)
    with (
        set_current_vllm_config(vllm_config),
        _CpuPlatformForModelCode(),
        set_default_torch_dtype(vllm_config.model_config.dtype),
        torch.device("meta"),
    ):
        model_cls(vllm_config=vllm_config, prefix="")
    return dict(get_layers_from_vllm_config(vllm_config, AttentionLayerBase))


def build_kv_cache_specs(
    vllm_config: VllmConfig, layers: dict[str, Any] | None = None
) -> dict[str, Any]:
    """layer name -> KVCacheSpec, as ``GPUModelRunner.get_kv_cache_spec`` reports them.

    Every layer of ``build_cache_layers`` answers ``get_kv_cache_spec`` itself: names,
    kinds, shapes and dtypes are vLLM's. Raises ``UnsupportedArchitecture`` for a cache
    the connector does not move.
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    arch = vllm_config.model_config.architecture
    layers = build_cache_layers(vllm_config) if layers is None else layers
    specs: dict[str, Any] = {}
    for name, layer in layers.items():
        spec = layer.get_kv_cache_spec(vllm_config)
        if spec is None:
            continue  # a layer without cache (e.g. encoder-only attention)
        if isinstance(spec, MambaSpec):
            if spec.mamba_type.name not in SUPPORTED_MAMBA_TYPES:
                raise UnsupportedArchitecture(
                    f"{arch}: layer {name} keeps {spec.mamba_type.name} state; the connector "
                    f"moves {' and '.join(SUPPORTED_MAMBA_TYPES)} state"
                )
        elif isinstance(spec, MLAAttentionSpec) or type(spec) not in (
            FullAttentionSpec,
            SlidingWindowSpec,
        ):
            raise UnsupportedArchitecture(
                f"{arch}: layer {name} keeps a {type(spec).__name__} cache; the check "
                "builds full attention, sliding window, Mamba2 and GatedDeltaNet caches"
            )
        specs[name] = spec
    if not specs:
        raise UnsupportedArchitecture(f"{arch}: no layer keeps a KV cache")
    return specs


def loaded_row_ids(parameter: Any, global_rows: int) -> Any:
    """Which checkpoint rows (dim 0) vLLM's own ``weight_loader`` of ``parameter``
    puts into this rank's copy, in local order: it loads a checkpoint tensor whose
    rows hold their own index into a CPU stand-in with ``parameter``'s shape and
    attributes. This is how the oracle knows, independently of the connector's
    ``mamba_conv``, which global channel or head each local state row holds."""
    import numpy as np
    import torch

    shape = tuple(parameter.shape)
    # the parameter's own class (vLLM's parameter classes load through methods)
    stand_in = torch.nn.Parameter.__new__(
        type(parameter), torch.full(shape, -1.0, dtype=torch.float64), requires_grad=False
    )
    stand_in.__dict__.update(vars(parameter))  # output_dim, weight_loader, tp rank, ...
    rows = torch.arange(global_rows, dtype=torch.float64).reshape(-1, *[1] * (len(shape) - 1))
    parameter.weight_loader(stand_in, rows.expand(global_rows, *shape[1:]).contiguous())
    ids = stand_in.detach().reshape(shape[0], -1)[:, 0].numpy().astype(np.int64)
    _require((ids >= 0).all(), f"vLLM's loader left rows of {tuple(shape)} unwritten")
    return ids


def state_row_ids(layer: Any, tp_size: int) -> tuple[Any, Any]:
    """(conv channel ids, state head ids) of this rank's Mamba2 / GatedDeltaNet layer,
    numbered as in the checkpoint: conv channels in ``conv1d`` order (x, B, C or q, k,
    v), heads by ``dt_bias`` (one per SSM / recurrent state head)."""
    conv_ids = loaded_row_ids(layer.conv1d.weight, layer.conv_dim)
    head_ids = loaded_row_ids(layer.dt_bias, layer.dt_bias.shape[0] * tp_size)
    return conv_ids, head_ids


def layer_plan(specs: dict[str, Any]) -> list[LayerPlan]:
    """Layers that hold KV cache, in model order, with vLLM's names and kinds."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    plans = []
    for name, spec in specs.items():
        if isinstance(spec, MambaSpec):
            kind = "mamba"
        elif isinstance(spec, SlidingWindowSpec):
            kind = "sliding"
        else:
            kind = "attention"
        plans.append(LayerPlan(extract_layer_index(name), kind, name))
    return sorted(plans, key=lambda plan: plan.layer_index)


# --------------------------------------------------------------------------- layout


@dataclass
class AttentionLayerView:
    layer_name: str
    group_index: int
    layer_index: int
    kv: torch.Tensor  # [num_kernel_blocks, 2, local_kv_heads, kernel_block_tokens, head_size]
    global_heads: list[int]


@dataclass
class MambaLayerView:
    layer_name: str
    group_index: int
    layer_index: int
    conv: torch.Tensor  # [num_logical_blocks, conv_dim_local, conv_rows]  (DS)
    ssm: torch.Tensor  # [num_logical_blocks, *ssm_state_shape_local]
    # global ids of the local conv channels and state heads, from vLLM's loaders
    conv_channel_ids: Any = None
    ssm_head_ids: Any = None


@dataclass
class EngineLayout:
    vllm_config: Any
    kv_cache_config: KVCacheConfig
    kv_caches: dict[str, Any]  # what the GPU runner passes to connector.register_kv_caches
    attention: list[AttentionLayerView]
    mamba: list[MambaLayerView]
    logical_block_tokens: int
    kernel_block_tokens: int
    physical_per_logical: int
    # extras
    tp_rank: int = 0
    tp_size: int = 1
    kernel_block_sizes: list[int] = field(default_factory=list)  # per KV cache group
    raw_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # layer -> int8 buffer
    kv_cache_layout: str = ""  # "HND" / "NHD" as get_kv_cache_layout() answered (0.33: "LBHNC")
    # vLLM 0.33: every distinct layer region of the one backing buffer, as int8
    # [logical block, block stride]; empty on 0.21 (each tensor is its own buffer)
    page_regions: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_logical_blocks(self) -> int:
        return self.kv_cache_config.num_blocks


class _RunnerStandIn:
    """The attributes ``GPUModelRunner``'s KV-allocation methods read; its methods (subst. 3)."""

    def __init__(self, vllm_config, kv_cache_config, attn_groups):
        import torch
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        self.vllm_config = vllm_config
        self.cache_config = vllm_config.cache_config
        self.kv_cache_config = kv_cache_config
        self.attn_groups = attn_groups
        self.runner_only_attn_layers: set[str] = set()
        if vllm_config.kv_transfer_config.kv_buffer_device == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        cls = GPUModelRunner
        self._allocate_kv_cache_tensors = cls._allocate_kv_cache_tensors.__get__(self)
        self._kv_cache_spec_attn_group_iterator = cls._kv_cache_spec_attn_group_iterator.__get__(
            self
        )
        self._reshape_kv_cache_tensors = cls._reshape_kv_cache_tensors.__get__(self)
        self._update_hybrid_attention_mamba_layout = (
            cls._update_hybrid_attention_mamba_layout.__get__(self)
        )


def _global_heads(total_kv_heads: int, tp_size: int, tp_rank: int, local: int) -> list[int]:
    # QKVParallelLinear: num_kv_head_replicas = tp_size // total when tp_size >= total;
    # the rank loads KV shard tp_rank // replicas of size `local` heads.
    if tp_size >= total_kv_heads:
        replicas = tp_size // total_kv_heads
        shard = tp_rank // replicas
    else:
        shard = tp_rank
    return list(range(shard * local, shard * local + local))


def layer_views(
    vllm_config: Any,
    tp_rank: int,
    kv_cache_config: Any,
    kv_caches: dict[str, Any],
    kernel_block_sizes: list[int],
    layers: dict[str, Any],
    specs: dict[str, Any],
    attention_kv: Any,
    mamba_states: Any,
) -> tuple[list[AttentionLayerView], list[MambaLayerView], set[int]]:
    """The oracle's views of every layer's cache, in model order, and the
    attention groups' kernel block sizes. The release's layout says how a
    layer's tensor looks: ``attention_kv(name, spec, group, tensor)`` gives
    ``[kernel blocks, 2, heads, tokens, head_size]``, ``mamba_states(name,
    tensor)`` the (conv, ssm) pair."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    plans = {p.layer_name: p for p in layer_plan(specs)}
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    total_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
    attention: list[AttentionLayerView] = []
    mamba: list[MambaLayerView] = []
    attn_kernel_sizes: set[int] = set()
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        for name in group.layer_names:
            layer_index = plans[name].layer_index
            if isinstance(spec, AttentionSpec):
                attn_kernel_sizes.add(kernel_block_sizes[gid])
                attention.append(
                    AttentionLayerView(
                        layer_name=name,
                        group_index=gid,
                        layer_index=layer_index,
                        kv=attention_kv(name, spec, gid, kv_caches[name]),
                        global_heads=_global_heads(
                            total_kv_heads, tp_size, tp_rank, spec.num_kv_heads
                        ),
                    )
                )
                continue
            conv, ssm = mamba_states(name, kv_caches[name])
            conv_ids, head_ids = state_row_ids(layers[name], tp_size)
            _require(len(conv_ids) == conv.shape[1] and len(head_ids) == ssm.shape[1], name)
            mamba.append(
                MambaLayerView(
                    layer_name=name,
                    group_index=gid,
                    layer_index=layer_index,
                    conv=conv,
                    ssm=ssm,
                    conv_channel_ids=conv_ids,
                    ssm_head_ids=head_ids,
                )
            )
    attention.sort(key=lambda v: v.layer_index)
    mamba.sort(key=lambda v: v.layer_index)
    _require(len(attn_kernel_sizes) <= 1, attn_kernel_sizes)
    return attention, mamba, attn_kernel_sizes


def build_engine_layout(vllm_config: VllmConfig, tp_rank: int) -> EngineLayout:
    """Allocate and shape TP rank ``tp_rank``'s KV cache in CPU memory, the GPU runner's way."""
    import copy

    from vllm_nixl_hma import _compat

    if _compat.builds_on("v033"):
        from vllm_nixl_hma.harness import layout_v033

        return layout_v033.build_engine_layout(vllm_config, tp_rank)

    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import get_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec
    from vllm.v1.worker.utils import AttentionGroup, prepare_kernel_block_sizes

    cc = vllm_config.cache_config
    pc = vllm_config.parallel_config
    _require(0 <= tp_rank < pc.tensor_parallel_size)
    if cc.num_gpu_blocks_override is None:
        raise ValueError("set cache_config.num_gpu_blocks_override (num_gpu_blocks)")
    if vllm_config.model_config.is_hybrid:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        if not is_conv_state_dim_first():
            raise RuntimeError("set VLLM_SSM_CONV_STATE_LAYOUT=DS before importing vLLM")

    ktc = vllm_config.kv_transfer_config
    extra = (ktc.kv_connector_extra_config or {}) if ktc is not None else {}
    if str(extra.get("enable_cross_layers_blocks", "False")).lower() == "true":
        # GPUModelRunner.initialize_kv_cache_tensors would take allocate_uniform_kv_caches
        # for a single-group model; that path is not reproduced here.
        raise NotImplementedError("enable_cross_layers_blocks (uniform KV cache) layout")

    layers = build_cache_layers(vllm_config)
    specs = build_kv_cache_specs(vllm_config, layers)
    attn_backend = _attention_backend_cls()

    with set_current_vllm_config(vllm_config):
        # Any bytes figure: with num_gpu_blocks_override set vLLM replaces it by
        # override * bytes-per-block.
        kv_cache_config = get_kv_cache_configs(vllm_config, [specs], [1 << 40])[0]
        # The runner works on a deep copy (GPUModelRunner.initialize_kv_cache).
        kv_cache_config = copy.deepcopy(kv_cache_config)

        # GPUModelRunner.initialize_attn_backend: one AttentionGroup per (backend, spec) per
        # KV cache group; every layer in a group here has the same backend and spec.
        attn_groups: list[list[Any]] = []
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if isinstance(spec, AttentionSpec):
                backend = attn_backend
            elif isinstance(spec, MambaSpec):
                backend = spec.mamba_type.get_class()
            else:
                raise NotImplementedError(type(spec).__name__)
            attn_groups.append([AttentionGroup(backend, list(group.layer_names), spec, gid)])
        kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attn_groups)

        runner = _RunnerStandIn(vllm_config, kv_cache_config, attn_groups)
        get_kv_cache_layout.cache_clear()  # substitution 5
        kv_cache_layout = get_kv_cache_layout()
        raw = runner._allocate_kv_cache_tensors(kv_cache_config)
        kv_caches = runner._reshape_kv_cache_tensors(raw, kernel_block_sizes)

    def attention_kv(name: str, spec: Any, gid: int, t: Any) -> Any:
        # FlashInfer's semantic shape (num_blocks, 2, block, heads, head_size)
        # whatever the physical stride order; we expose heads before tokens.
        shape = attn_backend.get_kv_cache_shape(
            t.shape[0], kernel_block_sizes[gid], spec.num_kv_heads, spec.head_size
        )
        _require(tuple(t.shape) == tuple(shape), (t.shape, shape))
        return t.permute(0, 1, 3, 2, 4)

    attention, mamba, attn_kernel_sizes = layer_views(
        vllm_config,
        tp_rank,
        kv_cache_config,
        kv_caches,
        kernel_block_sizes,
        layers,
        specs,
        attention_kv,
        mamba_states=lambda name, t: t,  # the runner's (conv, ssm) pair
    )
    logical = cc.block_size
    kernel = attn_kernel_sizes.pop() if attn_kernel_sizes else logical
    _require(logical % kernel == 0)
    return EngineLayout(
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
        raw_tensors=raw,
        kv_cache_layout=kv_cache_layout,
    )


# --------------------------------------------------------------------------- self-check


def _same_size_int(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _fill_ones_bytes(t: torch.Tensor) -> None:
    """Set every byte of the elements of view ``t`` to 0x01."""
    n = t.element_size()
    _same_size_int(t).fill_(int.from_bytes(b"\x01" * n, "little"))


def _byte_extent(view: torch.Tensor, base: torch.Tensor) -> tuple[int, int]:
    """[first, last] byte offset (relative to ``base``) that ``view`` can address."""
    es = view.element_size()
    lo = view.data_ptr() - base.data_ptr()
    hi = (
        lo
        + es * sum((s - 1) * st for s, st in zip(view.shape, view.stride(), strict=True))
        + es
        - 1
    )
    return lo, hi


def verify_layout(layout: EngineLayout, blocks: list[int] | None = None) -> dict[str, Any]:
    """Check that the views alias the runner's shared buffers as the runner intends.

    For every ``KVCacheTensor``: all views of the layers sharing it live in that one buffer and
    stay within it; page ``L`` of the buffer is exactly attention kernel blocks ``L*r..L*r+r-1``
    of every attention layer on it, and starts with Mamba block ``L``'s conv then SSM state of
    every Mamba layer on it. Writes are checked byte-exactly through the int8 buffer and across
    views. Zeroes the buffers it touches. Returns a few numbers for printing.
    """
    import torch

    kcc = layout.kv_cache_config
    n = kcc.num_blocks
    r = layout.physical_per_logical
    attn_by_name = {v.layer_name: v for v in layout.attention}
    mamba_by_name = {v.layer_name: v for v in layout.mamba}
    blocks = blocks if blocks is not None else sorted({0, 1, n // 2, n - 1})
    out: dict[str, Any] = {"tensors": len(kcc.kv_cache_tensors), "page_bytes": set()}
    for kt in kcc.kv_cache_tensors:
        raw = layout.raw_tensors[kt.shared_by[0]]
        _require(raw.dtype == torch.int8 and raw.numel() == kt.size)
        _require(kt.size % n == 0)
        page = kt.size // n
        out["page_bytes"].add(page)
        for name in kt.shared_by:
            _require(layout.raw_tensors[name] is raw)
            t = layout.kv_caches[name]
            parts = t if isinstance(t, list) else [t]
            for p in parts:  # same storage as the raw buffer, within it  (a, b)
                _require(p.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr())
                lo, hi = _byte_extent(p, raw)
                _require(0 <= lo and hi < kt.size, (name, lo, hi, kt.size))
            if name in attn_by_name:
                v = attn_by_name[name]
                _require(v.kv.shape[0] == n * r)
                # attention fills the whole buffer
                _require(v.kv.numel() * v.kv.element_size() == kt.size, name)
                _require(v.kv.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr())
            if name in mamba_by_name:
                v = mamba_by_name[name]
                _require(v.conv.shape[0] == n and v.ssm.shape[0] == n)
                per_block = (
                    v.conv[0].numel() * v.conv.element_size()
                    + v.ssm[0].numel() * v.ssm.element_size()
                )
                _require(per_block <= page)
                total = (
                    v.conv.numel() * v.conv.element_size() + v.ssm.numel() * v.ssm.element_size()
                )
                _require(total <= kt.size, name, total, kt.size)
        # byte-exact write checks
        for L in blocks:
            expect = torch.zeros(kt.size, dtype=torch.bool)
            expect[L * page : (L + 1) * page] = True
            for name in kt.shared_by:
                if name in attn_by_name:
                    v = attn_by_name[name]
                    raw.zero_()
                    _fill_ones_bytes(v.kv[L * r : (L + 1) * r])
                    got = raw == 1
                    _require(torch.equal(got, expect), (name, L, "attention page"))
                    _require(int((raw != 0).sum()) == page)
                    # visible through the runner's own tensor
                    _require(
                        bool(
                            (_same_size_int(layout.kv_caches[name][L * r : (L + 1) * r]) != 0).all()
                        )
                    )
                if name in mamba_by_name:
                    v = mamba_by_name[name]
                    cb = v.conv[0].numel() * v.conv.element_size()
                    sb = v.ssm[0].numel() * v.ssm.element_size()
                    raw.zero_()
                    _fill_ones_bytes(v.conv[L])
                    e = torch.zeros(kt.size, dtype=torch.bool)
                    e[L * page : L * page + cb] = True
                    _require(torch.equal(raw == 1, e), (name, L, "conv"))
                    raw.zero_()
                    _fill_ones_bytes(v.ssm[L])
                    e = torch.zeros(kt.size, dtype=torch.bool)
                    e[L * page + cb : L * page + cb + sb] = True
                    _require(torch.equal(raw == 1, e), (name, L, "ssm"))
                    # the runner's list holds the same views' memory
                    conv_r, ssm_r = layout.kv_caches[name]
                    _require(bool((_same_size_int(ssm_r[L]) != 0).all()))
                    # ... and an attention layer on the same tensor sees it in its block L
                    for other in kt.shared_by:
                        if other in attn_by_name:
                            a = attn_by_name[other].kv[L * r : (L + 1) * r]
                            _require(bool((_same_size_int(a) != 0).any()), (other, L))
                            if L + 1 < n:
                                a2 = attn_by_name[other].kv[(L + 1) * r : (L + 2) * r]
                                _require(not bool((_same_size_int(a2) != 0).any()))
        raw.zero_()
    out["page_bytes"] = sorted(out["page_bytes"])
    return out


# --------------------------------------------------------------------------- one-process TP 1


class single_process_tp_group:  # noqa: N801 (a context manager, used like a function)
    """vLLM's TP group of size 1 in this process (gloo on 127.0.0.1), for
    building a TP 1 layout outside a rank process; torn down on exit."""

    def __init__(self, vllm_config: VllmConfig):
        self.vllm_config = vllm_config

    def __enter__(self):
        import socket

        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel

        _require(self.vllm_config.parallel_config.tensor_parallel_size == 1)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(self.vllm_config):
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=0,
                backend="gloo",
            )
            initialize_model_parallel(tensor_model_parallel_size=1)
        return self

    def __exit__(self, *exc_info):
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
        return False
