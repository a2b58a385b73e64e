"""Which bytes of a Mamba2 or GatedDeltaNet state to read from which prefill rank.

Pure arithmetic: no vLLM, no torch, numpy and the standard library only, so the
rules are tested exhaustively against a byte-level simulation
(tests/unit/test_mamba_conv.py) and tied to vLLM's own loader there.

One description serves both layer types. A layer's conv state (DS layout: each
channel's ``conv_rows`` elements contiguous) is a sequence of named *parts*, each
sharded across TP ranks or replicated on every rank (``ConvPart``); its SSM /
recurrent state is ``(heads // tp, ...)``, heads always sharded. A state model
(``Mamba2State``, ``GatedDeltaNetState``) gives the parts at a TP size; every
plan below is computed from parts alone.

vLLM 0.21.0's rules, restated (line numbers in the installed ``site-packages/vllm``)
---------------------------------------------------------------------------------

Both layers load their conv weight with ``mamba_v2_sharded_weight_loader``
(``model_executor/layers/mamba/mamba_mixer2.py`` 168-230), whose shard spec is one
``(full_dim, extra, duplicate_groups)`` per part: rank ``r`` takes
``min(full_dim // tp, full_dim - extra - rank*(full_dim // tp))`` channels from
``rank*(full_dim // tp)`` of that part, with ``rank = 0 if duplicate_groups else r``
(200, 207), parts laid out one after the other.

* Mamba2 (``MambaMixer2.__init__``): parts x (``intermediate_size``), B and C
  (``n_groups * d_state`` each). vLLM accepts ``n_groups % tp == 0 or n_groups ==
  1`` (286). When ``tp`` divides ``n_groups`` conv1d is a
  ``MergedColumnParallelLinear`` (312-322; ``layers/linear.py`` 812-815, 851-853):
  every part sharded. Otherwise (one group, ``tp > 1``) the group count is padded
  to ``tp`` (299-310) and B, C have ``duplicate_groups`` (338-367): every rank holds
  group 0 whole, x is still sharded. The forward pass splits the channels as
  ``[intermediate_size // tp, groups_ss // tp, groups_ss // tp]`` (506-513). SSM
  state ``(num_heads // tp, head_dim, d_state)`` (``mamba_utils.py`` 162-187).
* GatedDeltaNet (``model_executor/layers/mamba/gdn_linear_attn.py``,
  ``GatedDeltaNetAttention.__init__``): ``key_dim = linear_key_head_dim *
  linear_num_key_heads``, ``value_dim = linear_value_head_dim *
  linear_num_value_heads`` (272-278); conv1d is a ``ColumnParallelLinear`` of
  ``2 * key_dim + value_dim`` (312-318) loaded with the spec ``[(key_dim, 0, False),
  (key_dim, 0, False), (value_dim, 0, False)]`` (344-356): parts q, k, v, each
  sharded, split in the forward pass as ``[key_dim // tp, key_dim // tp,
  value_dim // tp]`` (635-639). Key and value sizes differ in real models. The
  recurrent state is ``(num_v_heads // tp, head_v_dim, head_k_dim)``
  (``mamba_utils.py`` 213-234).

How vLLM 0.21.0's NIXL worker reads them (what goes wrong)
-----------------------------------------------------------

``nixl/tp_mapping.py``, ``compute_tp_mapping`` (97-104): for SSM groups decode rank
``r`` reads prefill ranks ``r*k .. r*k+k-1`` when ``P_TP = k * D_TP``, and prefill
rank ``r * P_TP // D_TP`` otherwise. ``nixl/worker.py``:
``_build_local_splits_from_plan`` (153-197) splits each local conv part and the
SSM region into ``k`` equal chunks, chunk ``i`` filled from the ``i``-th source
rank; ``_build_mamba_remote`` (1021-1077) takes offsets from
``MambaConvSplitInfo`` (``ssm_conv_transfer_utils.py`` 62-164), which only knows
Mamba2 (x, then B and C of equal size) and raises ``NotImplementedError`` for any
other type, GatedDeltaNet included; and which assumes B and C sharded like x, so
with a replicated group and ``P_TP != D_TP`` B/C arrive wrong while x and the SSM
state are right.

The rule used here: every rank's region of a part is a contiguous run of that
part's global (unpadded) channels, so a decode chunk is read from its source
prefill rank at ``prefill region start + (chunk's global start - prefill region's
global start)``, after checking that the prefill rank holds the whole chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "ConvPart",
    "GatedDeltaNetState",
    "Mamba2State",
    "ReadSlice",
    "StateModel",
    "StateRegion",
    "conv_channel_ids",
    "conv_read_plan",
    "conv_regions",
    "gated_delta_net_state",
    "groups_replicated",
    "mamba2_params",
    "padded_n_groups",
    "plan_by_p_rank",
    "respects_vllm_local_splits",
    "source_p_ranks",
    "ssm_head_ids",
    "ssm_read_plan",
    "state_model_of",
    "stock_conv_read_plan",
    "stock_ssm_read_plan",
    "vllm_local_chunks",
]

#: The component name of the SSM / recurrent state in a ``ReadSlice``.
SSM = "ssm"


@dataclass(frozen=True)
class ReadSlice:
    """One read: ``size_bytes`` from prefill rank ``p_rank`` into the decode page.

    Conv offsets are relative to the start of the conv state in one block's page; SSM
    offsets (component ``"ssm"``) are relative to the start of the SSM state.
    """

    p_rank: int
    component: str
    remote_offset_bytes: int
    local_offset_bytes: int
    size_bytes: int


@dataclass(frozen=True)
class StateRegion:
    """Where one component (a conv part, or the SSM heads) sits on one rank.

    ``page_offset_bytes``: offset inside the rank's conv state (SSM: its SSM state).
    ``global_offset_bytes``: offset inside the global (unpadded, un-sharded)
    component array in DS layout, i.e. ``first global channel * row bytes``.
    """

    component: str
    page_offset_bytes: int
    global_offset_bytes: int
    size_bytes: int


@dataclass(frozen=True)
class ConvPart:
    """One named part of a conv state at one TP size (an entry of the shard spec
    vLLM hands ``mamba_v2_sharded_weight_loader``).

    ``channels``: the part's global channel count, unpadded. Sharded: rank ``r``
    holds channels ``r*channels/tp .. (r+1)*channels/tp - 1``. Replicated: every
    rank holds all of them (vLLM's ``duplicate_groups``).
    """

    name: str
    channels: int
    replicated: bool = False


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_rank(tp_size: int, tp_rank: int, side: str = "") -> None:
    _require_positive(tp_size=tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"{side}tp_rank {tp_rank} out of range for tp_size {tp_size}")


def _check_tp_pair(p_tp: int, d_tp: int, d_rank: int) -> None:
    _check_rank(d_tp, d_rank, side="decode ")
    _require_positive(p_tp=p_tp)
    if p_tp % d_tp and d_tp % p_tp:
        raise ValueError(f"one of p_tp {p_tp} and d_tp {d_tp} must divide the other")


def _check_divides(tp_size: int, what: str, count: int) -> None:
    if count % tp_size:
        raise ValueError(f"tp_size {tp_size} must divide {what} {count}")


# ----------------------------------------------------------------------------
# The state models: a layer's conv parts and state heads at a TP size
# ----------------------------------------------------------------------------


def padded_n_groups(n_groups: int, tp_size: int) -> int:
    """mamba_utils.py ``extra_groups_for_head_shards``: the group count vLLM allocates."""
    if n_groups % tp_size == 0:
        return n_groups
    return n_groups + (tp_size - n_groups)


def groups_replicated(n_groups: int, tp_size: int) -> bool:
    """True when ranks hold copies of the same group instead of disjoint shards."""
    return n_groups % tp_size != 0


@dataclass(frozen=True)
class Mamba2State:
    """A Mamba2 mixer's dimensions (global, before TP): conv parts x, B, C."""

    intermediate_size: int
    n_groups: int
    d_state: int
    num_heads: int

    kind = "mamba2"

    def conv_parts(self, tp_size: int) -> tuple[ConvPart, ...]:
        """The configurations MambaMixer2.__init__ (vLLM 0.21.0) accepts, and
        how it shards them (module docstring)."""
        _require_positive(
            intermediate_size=self.intermediate_size,
            n_groups=self.n_groups,
            d_state=self.d_state,
            num_heads=self.num_heads,
            tp_size=tp_size,
        )
        _check_divides(tp_size, "num_heads", self.num_heads)
        if self.intermediate_size % self.num_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must divide intermediate_size {self.intermediate_size}"
            )
        if self.n_groups % tp_size and self.n_groups != 1:
            raise ValueError(
                f"vLLM's Mamba2 mixer needs tp_size ({tp_size}) to divide n_groups "
                f"({self.n_groups}) or n_groups == 1"
            )
        replicated = groups_replicated(self.n_groups, tp_size)
        groups_ss = self.n_groups * self.d_state
        return (
            ConvPart("x", self.intermediate_size),
            ConvPart("B", groups_ss, replicated),
            ConvPart("C", groups_ss, replicated),
        )

    @property
    def state_heads(self) -> int:
        """Heads of the SSM state (always sharded)."""
        return self.num_heads


@dataclass(frozen=True)
class GatedDeltaNetState:
    """A GatedDeltaNet layer's dimensions (global): conv parts q, k, v.

    q and k have ``num_k_heads * head_k_dim`` channels, v has ``num_v_heads *
    head_v_dim``: in real models (Qwen3-Next, Qwen3.5) these differ.
    """

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    kind = "gdn"

    def conv_parts(self, tp_size: int) -> tuple[ConvPart, ...]:
        """GatedDeltaNetAttention.__init__ (vLLM 0.21.0): all three parts sharded."""
        _require_positive(
            num_k_heads=self.num_k_heads,
            num_v_heads=self.num_v_heads,
            head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim,
            tp_size=tp_size,
        )
        # the forward pass reshapes by num_k_heads // tp and num_v_heads // tp
        _check_divides(tp_size, "linear_num_key_heads", self.num_k_heads)
        _check_divides(tp_size, "linear_num_value_heads", self.num_v_heads)
        key_dim = self.num_k_heads * self.head_k_dim
        return (
            ConvPart("q", key_dim),
            ConvPart("k", key_dim),
            ConvPart("v", self.num_v_heads * self.head_v_dim),
        )

    @property
    def state_heads(self) -> int:
        """Heads of the recurrent state ``(num_v_heads // tp, head_v_dim, head_k_dim)``."""
        return self.num_v_heads


StateModel = Mamba2State | GatedDeltaNetState


# ----------------------------------------------------------------------------
# Layout of one rank
# ----------------------------------------------------------------------------


def _local_channels(part: ConvPart, tp_size: int, tp_rank: int) -> range:
    """Global channels of ``part`` that ``tp_rank`` holds, in order."""
    if part.replicated:
        return range(part.channels)
    per_rank = part.channels // tp_size
    return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)


def _parts(model: StateModel, tp_size: int, tp_rank: int) -> tuple[ConvPart, ...]:
    parts = model.conv_parts(tp_size)
    _check_rank(tp_size, tp_rank)
    for part in parts:
        if not part.replicated:
            _check_divides(tp_size, f"the {part.name} channels", part.channels)
    return parts


def conv_channel_ids(model: StateModel, tp_size: int, tp_rank: int) -> npt.NDArray[np.int64]:
    """Global id of each local conv channel of ``tp_rank``, in conv-state order.

    Parts are numbered one after the other: channel ``c`` of the part that
    follows parts of ``n`` channels in all is ``n + c`` (Mamba2: x, then B,
    then C; GatedDeltaNet: q, k, v). Replicated parts give the same ids on
    every rank.
    """
    ids = []
    first_global = 0
    for part in _parts(model, tp_size, tp_rank):
        local = _local_channels(part, tp_size, tp_rank)
        ids.append(np.arange(local.start, local.stop, dtype=np.int64) + first_global)
        first_global += part.channels
    return np.concatenate(ids)


def ssm_head_ids(num_heads: int, tp_size: int, tp_rank: int) -> npt.NDArray[np.int64]:
    """Global heads of ``tp_rank``'s SSM state (heads always sharded)."""
    _require_positive(num_heads=num_heads)
    _check_rank(tp_size, tp_rank)
    _check_divides(tp_size, "num_heads", num_heads)
    per_rank = num_heads // tp_size
    return np.arange(tp_rank * per_rank, (tp_rank + 1) * per_rank, dtype=np.int64)


def conv_regions(
    model: StateModel, conv_rows: int, dtype_size: int, tp_size: int, tp_rank: int
) -> dict[str, StateRegion]:
    """Every conv part's region on ``tp_rank``, in bytes, in conv-state order."""
    _require_positive(conv_rows=conv_rows, dtype_size=dtype_size)
    row_bytes = conv_rows * dtype_size
    regions = {}
    page_offset_bytes = 0
    for part in _parts(model, tp_size, tp_rank):
        local = _local_channels(part, tp_size, tp_rank)
        size_bytes = len(local) * row_bytes
        regions[part.name] = StateRegion(
            part.name, page_offset_bytes, local.start * row_bytes, size_bytes
        )
        page_offset_bytes += size_bytes
    return regions


def _ssm_region(num_heads: int, head_bytes: int, tp_size: int, tp_rank: int) -> StateRegion:
    heads = ssm_head_ids(num_heads, tp_size, tp_rank)
    return StateRegion(SSM, 0, int(heads[0]) * head_bytes, len(heads) * head_bytes)


# ----------------------------------------------------------------------------
# Which prefill ranks a decode rank reads (mirrors compute_tp_mapping, SSM groups)
# ----------------------------------------------------------------------------


def source_p_ranks(p_tp: int, d_tp: int, d_rank: int) -> list[int]:
    """Prefill ranks ``d_rank`` reads for SSM groups, in local-chunk order."""
    _check_tp_pair(p_tp, d_tp, d_rank)
    if d_tp < p_tp:
        k = p_tp // d_tp
        return list(range(d_rank * k, (d_rank + 1) * k))
    return [d_rank * p_tp // d_tp]


def _equal_chunk(size_bytes: int, num_chunks: int, index: int) -> tuple[int, int]:
    """(offset, size) of chunk ``index``; equal when ``num_chunks`` divides ``size_bytes``."""
    start = size_bytes * index // num_chunks
    return start, size_bytes * (index + 1) // num_chunks - start


def _plan_from_regions(
    d_regions: Sequence[StateRegion],
    p_regions_by_rank: dict[int, dict[str, StateRegion]],
    sources: Sequence[int],
) -> list[ReadSlice]:
    """Chunk ``i`` of each decode region comes from ``sources[i]`` at the same global bytes."""
    plan: list[ReadSlice] = []
    for d_region in d_regions:
        for index, p_rank in enumerate(sources):
            chunk_offset_bytes, chunk_size_bytes = _equal_chunk(
                d_region.size_bytes, len(sources), index
            )
            p_region = p_regions_by_rank[p_rank][d_region.component]
            offset_in_p_region_bytes = (
                d_region.global_offset_bytes + chunk_offset_bytes - p_region.global_offset_bytes
            )
            if (
                offset_in_p_region_bytes < 0
                or offset_in_p_region_bytes + chunk_size_bytes > p_region.size_bytes
            ):
                raise ValueError(
                    f"prefill rank {p_rank} does not hold decode chunk {index} of "
                    f"{d_region.component}"
                )
            plan.append(
                ReadSlice(
                    p_rank=p_rank,
                    component=d_region.component,
                    remote_offset_bytes=p_region.page_offset_bytes + offset_in_p_region_bytes,
                    local_offset_bytes=d_region.page_offset_bytes + chunk_offset_bytes,
                    size_bytes=chunk_size_bytes,
                )
            )
    return plan


# ----------------------------------------------------------------------------
# Correct plans
# ----------------------------------------------------------------------------


def conv_read_plan(
    model: StateModel, conv_rows: int, dtype_size: int, p_tp: int, d_tp: int, d_rank: int
) -> list[ReadSlice]:
    """Reads that fill decode rank ``d_rank``'s conv state with the right channels.

    Ordered by part (conv-state order), then by source rank. When ``P_TP > D_TP``
    the local side of each part is cut into ``k`` chunks like
    ``_build_local_splits_from_plan`` does; where a region's byte size is not a
    multiple of ``k`` the chunks are uneven (see ``respects_vllm_local_splits``).
    """
    _check_tp_pair(p_tp, d_tp, d_rank)
    sources = source_p_ranks(p_tp, d_tp, d_rank)
    d_regions = conv_regions(model, conv_rows, dtype_size, d_tp, d_rank)
    p_regions_by_rank = {p: conv_regions(model, conv_rows, dtype_size, p_tp, p) for p in sources}
    return _plan_from_regions(list(d_regions.values()), p_regions_by_rank, sources)


def ssm_read_plan(
    num_heads: int, head_bytes: int, p_tp: int, d_tp: int, d_rank: int
) -> list[ReadSlice]:
    """Reads of the SSM state; offsets relative to the SSM state's start.

    ``head_bytes`` is one head's state (Mamba2: ``head_dim * d_state``;
    GatedDeltaNet: ``head_v_dim * head_k_dim``; times the state dtype size).
    """
    _check_tp_pair(p_tp, d_tp, d_rank)
    _require_positive(head_bytes=head_bytes)
    sources = source_p_ranks(p_tp, d_tp, d_rank)
    d_region = _ssm_region(num_heads, head_bytes, d_tp, d_rank)
    p_regions: dict[int, dict[str, StateRegion]] = {
        p: {SSM: _ssm_region(num_heads, head_bytes, p_tp, p)} for p in sources
    }
    return _plan_from_regions([d_region], p_regions, sources)


def plan_by_p_rank(plan: Sequence[ReadSlice]) -> dict[int, list[ReadSlice]]:
    """Slices grouped per prefill rank, in plan order (one NIXL handle per rank)."""
    grouped: dict[int, list[ReadSlice]] = {}
    for read in plan:
        grouped.setdefault(read.p_rank, []).append(read)
    return grouped


def vllm_local_chunks(
    region_offsets: Sequence[tuple[int, int]], num_chunks: int, index: int
) -> list[tuple[int, int]]:
    """``_build_local_splits_from_plan``: chunk ``index`` of each (offset, size) region."""
    chunks = []
    for offset_bytes, size_bytes in region_offsets:
        chunk_bytes = size_bytes // num_chunks
        chunks.append((offset_bytes + index * chunk_bytes, chunk_bytes))
    return chunks


def respects_vllm_local_splits(
    plan: Sequence[ReadSlice],
    model: StateModel,
    conv_rows: int,
    dtype_size: int,
    p_tp: int,
    d_tp: int,
    d_rank: int,
) -> bool:
    """Whether ``plan``'s local side equals what vLLM registers locally: each
    local part whole (``D_TP >= P_TP``), or cut into ``P_TP // D_TP`` equal
    chunks by ``_build_local_splits_from_plan``, chunk ``i`` for source ``i``.

    False (a replicated B/C region whose byte size is not a multiple of
    ``P_TP // D_TP``) means the plan cannot be posted through vLLM's local
    descriptors.
    """
    regions = conv_regions(model, conv_rows, dtype_size, d_tp, d_rank)
    region_offsets = [(r.page_offset_bytes, r.size_bytes) for r in regions.values()]
    sources = source_p_ranks(p_tp, d_tp, d_rank)
    vllm_local = [
        (p_rank, name, offset_bytes, size_bytes)
        for part_index, name in enumerate(regions)
        for index, p_rank in enumerate(sources)
        for offset_bytes, size_bytes in [
            vllm_local_chunks(region_offsets, len(sources), index)[part_index]
        ]
    ]
    local = [(r.p_rank, r.component, r.local_offset_bytes, r.size_bytes) for r in plan]
    return local == vllm_local


# ----------------------------------------------------------------------------
# What stock vLLM 0.21.0 registers (Mamba2 only: it refuses every other type)
# ----------------------------------------------------------------------------


def stock_conv_read_plan(
    model: Mamba2State, conv_rows: int, dtype_size: int, p_tp: int, d_tp: int, d_rank: int
) -> list[ReadSlice]:
    """The x/B/C reads stock vLLM 0.21.0 registers (``_build_mamba_remote`` + local side).

    ``derive_mamba_conv_split`` gives decode ``x_bytes`` and ``b_bytes`` from its
    own (padded) conv dim; the prefill-side offsets assume B and C sharded like x.
    """
    _check_tp_pair(p_tp, d_tp, d_rank)
    model.conv_parts(d_tp)  # validates
    _require_positive(conv_rows=conv_rows, dtype_size=dtype_size)
    row_bytes = conv_rows * dtype_size
    padded_groups_ss = padded_n_groups(model.n_groups, d_tp) * model.d_state
    x_bytes = model.intermediate_size // d_tp * row_bytes
    b_bytes = padded_groups_ss // d_tp * row_bytes
    local_offsets = [(0, x_bytes), (x_bytes, b_bytes), (x_bytes + b_bytes, b_bytes)]
    sources = source_p_ranks(p_tp, d_tp, d_rank)
    if d_tp >= p_tp:
        ratio = d_tp // p_tp
        rank_offset = d_rank % ratio
        remote_x_bytes, remote_b_bytes = x_bytes * ratio, b_bytes * ratio
        remote_offsets = [
            (rank_offset * x_bytes, x_bytes),
            (remote_x_bytes + rank_offset * b_bytes, b_bytes),
            (remote_x_bytes + remote_b_bytes + rank_offset * b_bytes, b_bytes),
        ]
        per_rank = {sources[0]: (remote_offsets, local_offsets)}
    else:
        abs_ratio = p_tp // d_tp
        xb_p, bb_p = x_bytes // abs_ratio, b_bytes // abs_ratio
        remote_offsets = [(0, xb_p), (xb_p, bb_p), (xb_p + bb_p, bb_p)]
        per_rank = {
            p: (remote_offsets, vllm_local_chunks(local_offsets, abs_ratio, index))
            for index, p in enumerate(sources)
        }
    plan = []
    for part_index, name in enumerate(("x", "B", "C")):
        for p_rank, (remote, local) in per_rank.items():
            remote_offset_bytes, size_bytes = remote[part_index]
            local_offset_bytes, local_size_bytes = local[part_index]
            if local_size_bytes != size_bytes:
                raise ValueError(f"stock descriptor sizes differ for {name}")
            plan.append(
                ReadSlice(p_rank, name, remote_offset_bytes, local_offset_bytes, size_bytes)
            )
    return plan


def stock_ssm_read_plan(
    num_heads: int, head_bytes: int, p_tp: int, d_tp: int, d_rank: int
) -> list[ReadSlice]:
    """SSM reads of stock 0.21.0: ``local_offset * ssm_read_size`` / full remote state."""
    _check_tp_pair(p_tp, d_tp, d_rank)
    d_ssm_bytes = num_heads // d_tp * head_bytes
    p_ssm_bytes = num_heads // p_tp * head_bytes
    sources = source_p_ranks(p_tp, d_tp, d_rank)
    if d_tp >= p_tp:
        rank_offset = d_rank % (d_tp // p_tp)
        return [ReadSlice(sources[0], SSM, rank_offset * d_ssm_bytes, 0, d_ssm_bytes)]
    plan = []
    for index, p_rank in enumerate(sources):
        [(local_offset_bytes, local_size_bytes)] = vllm_local_chunks(
            [(0, d_ssm_bytes)], len(sources), index
        )
        if local_size_bytes != p_ssm_bytes:
            raise ValueError("stock SSM descriptor sizes differ")
        plan.append(ReadSlice(p_rank, SSM, 0, local_offset_bytes, p_ssm_bytes))
    return plan


# ----------------------------------------------------------------------------
# State models of HF configs
# ----------------------------------------------------------------------------


def _first_present(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def mamba2_params(hf_config: Any) -> Mamba2State | None:
    """Mamba2 dimensions of a HF config (Bamba, GraniteMoeHybrid, NemotronH,
    FalconH1, Zamba2 field names), or None when the config has none of them."""
    num_heads = _first_present(hf_config, "mamba_n_heads", "mamba_num_heads")
    n_groups = _first_present(hf_config, "mamba_n_groups", "n_groups")
    d_state = _first_present(hf_config, "mamba_d_state", "ssm_state_size")
    if num_heads is None or n_groups is None or d_state is None:
        return None
    head_dim = _first_present(hf_config, "mamba_d_head", "mamba_head_dim")
    if head_dim is not None and head_dim != "auto":
        intermediate_size = int(num_heads) * int(head_dim)
    else:
        expand = _first_present(hf_config, "mamba_expand", "expand")
        intermediate_size = int(expand) * int(hf_config.hidden_size)
    return Mamba2State(
        intermediate_size=int(intermediate_size),
        n_groups=int(n_groups),
        d_state=int(d_state),
        num_heads=int(num_heads),
    )


def gated_delta_net_state(hf_config: Any) -> GatedDeltaNetState | None:
    """GatedDeltaNet dimensions of a HF config (Qwen3-Next, Qwen3.5 text config:
    the fields ``GatedDeltaNetAttention.__init__`` reads), or None."""
    names = (
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
    )
    values = [getattr(hf_config, name, None) for name in names]
    if any(value is None for value in values):
        return None
    return GatedDeltaNetState(*(int(value) for value in values))


#: vLLM's ``MambaAttentionBackendEnum`` member name -> state model of a HF config
_STATE_MODELS = {"MAMBA2": mamba2_params, "GDN_ATTN": gated_delta_net_state}


def state_model_of(hf_config: Any, mamba_type: str) -> StateModel | None:
    """The state model of a layer whose ``MambaSpec.mamba_type`` is named
    ``mamba_type``; None for a type whose state this module does not describe
    (Mamba1, short conv, linear attention, ...) or a config without the fields."""
    reader = _STATE_MODELS.get(mamba_type)
    return None if reader is None else reader(hf_config)
