"""Which bytes of a Mamba2 state to read from which prefill rank (pure arithmetic).

No vLLM, no torch: numpy and the standard library only, so the rules are tested
exhaustively against a byte-level simulation (tests/unit/test_mamba_conv.py).

How vLLM 0.21.0 lays out one Mamba2 layer's state per TP rank (DS conv layout)
-------------------------------------------------------------------------------

* ``model_executor/layers/mamba/mamba_utils.py``,
  ``MambaStateShapeCalculator.mamba2_state_shape``: the conv state of one block is
  ``(conv_dim // tp, conv_kernel - 1)`` with ``conv_dim = intermediate_size +
  2 * n_groups_padded * d_state`` (``_orient_conv_shape`` keeps that order for DS),
  and the SSM state is ``(num_heads // tp, head_dim, d_state)``, heads always sharded.
  ``n_groups_padded = n_groups + extra_groups_for_head_shards(n_groups, tp)``: 0 extra
  when ``tp`` divides ``n_groups``, else ``tp - n_groups``.
* ``model_executor/layers/mamba/mamba_mixer2.py``, ``MambaMixer2.__init__``: vLLM only
  accepts ``n_groups % tp == 0 or n_groups == 1`` (the assert before ``self.n_groups``
  is set). When ``tp`` divides ``n_groups`` the conv weights are a
  ``MergedColumnParallelLinear`` with output sizes ``[intermediate_size, G*d_state,
  G*d_state]``; its ``weight_loader`` (``layers/linear.py``: ``shard_offset =
  sum(output_sizes[:id]) // tp_size``, ``start_idx = tp_rank * shard_size``) gives
  rank ``r`` the ``r``-th contiguous shard of x, of B and of C, laid out x, B, C.
  Otherwise (``n_groups == 1``, ``tp > 1``) conv1d is a plain ``ColumnParallelLinear``
  loaded by ``mamba_v2_sharded_weight_loader`` with ``group_shard_settings =
  (n_groups_padded*d_state, (n_groups_padded - n_groups)*d_state, n_groups == 1)``:
  for B and C ``rank = 0 if duplicate_groups else tp_rank`` and ``take =
  min(shard_size, full_dim - extra - loaded_skip) = d_state``, so *every* rank holds
  group 0 whole (x is still sharded by ``tp_rank``). The forward pass splits the conv
  channels as ``[intermediate_size // tp, groups_ss // tp, groups_ss // tp]``
  (``split_hidden_states_B_C_fn``), and the conv state rows are those channels.
* In the DS layout a channel's ``conv_rows`` elements are contiguous, so on every
  rank x, B and C are three contiguous byte ranges of the conv page.

Line numbers in the installed vLLM 0.21.0 (``site-packages/vllm``):
``model_executor/layers/mamba/mamba_mixer2.py`` 168-230 (``mamba_v2_sharded_weight_loader``;
200 ``rank = 0 if duplicate_groups``, 207 ``take = min(...)``), 286 (the n_groups assert),
299-310 (padding), 312-322 (merged, sharded conv1d), 338-367 (replicated conv1d,
``group_shard_settings``), 506-513 (x/B/C split); ``model_executor/layers/linear.py``
812-815 and 851-853 (``MergedColumnParallelLinear.weight_loader`` shard offset and
``start_idx``); ``model_executor/layers/mamba/mamba_utils.py`` 162-187 and 201-210;
``distributed/kv_transfer/kv_connector/v1/nixl/tp_mapping.py`` 97-104 (SSM source ranks);
``.../v1/nixl/worker.py`` 153-197 (``_build_local_splits_from_plan``), 981-1019
(``_build_mamba_local``), 1021-1077 (``_build_mamba_remote``);
``.../v1/ssm_conv_transfer_utils.py`` 62-85 (``remote_conv_offsets``), 88-164
(``derive_mamba_conv_split``).

How vLLM 0.21.0 reads them (what goes wrong)
--------------------------------------------

``distributed/kv_transfer/kv_connector/v1/nixl/tp_mapping.py``, ``compute_tp_mapping``:
for SSM groups decode rank ``r`` reads prefill ranks ``r*k .. r*k+k-1`` when
``P_TP = k * D_TP``, and prefill rank ``r * P_TP // D_TP`` otherwise.
``nixl/worker.py``: ``_build_local_splits_from_plan`` splits each local x, B, C and SSM
region into ``k`` equal chunks, chunk ``i`` filled from the ``i``-th source rank;
``_build_mamba_remote`` reads offsets from ``MambaConvSplitInfo.remote_conv_offsets``
(``ssm_conv_transfer_utils.py``) when ``D_TP >= P_TP`` and the decode sizes divided by
``k`` when ``P_TP > D_TP``. Both assume B and C are sharded like x. With a replicated
group (``n_groups == 1`` and a TP above 1 on either side) and ``P_TP != D_TP`` that
is false and B/C arrive wrong while x and the SSM state are right.

The rule used here: every rank's x, B and C region is a contiguous run of one
*global* component array (x, or the unpadded ``n_groups * d_state`` B/C channels), so
a decode chunk is read from its source prefill rank at ``prefill region start +
(chunk's global start - prefill region's global start)``, after checking that the
prefill rank holds the whole chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "CONV_COMPONENTS",
    "ReadSlice",
    "StateRegion",
    "conv_channel_ids",
    "conv_read_plan",
    "conv_regions",
    "groups_replicated",
    "local_group_ids",
    "padded_n_groups",
    "plan_by_p_rank",
    "respects_vllm_local_splits",
    "source_p_ranks",
    "ssm_head_ids",
    "ssm_read_plan",
    "stock_conv_read_plan",
    "stock_ssm_read_plan",
    "vllm_local_chunks",
]

Component = Literal["x", "B", "C", "ssm"]
CONV_COMPONENTS: tuple[Component, ...] = ("x", "B", "C")


@dataclass(frozen=True)
class ReadSlice:
    """One read: ``size_bytes`` from prefill rank ``p_rank`` into the decode page.

    Conv offsets are relative to the start of the conv state in one block's page; SSM
    offsets (component ``"ssm"``) are relative to the start of the SSM state.
    """

    p_rank: int
    component: Component
    remote_offset_bytes: int
    local_offset_bytes: int
    size_bytes: int


@dataclass(frozen=True)
class StateRegion:
    """Where one component (x, B, C or the SSM heads) sits on one rank.

    ``page_offset_bytes``: offset inside the rank's conv state (SSM: its SSM state).
    ``global_offset_bytes``: offset inside the global (unpadded, un-sharded)
    component array in DS layout, i.e. ``first global channel * row bytes``.
    """

    component: Component
    page_offset_bytes: int
    global_offset_bytes: int
    size_bytes: int


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


def _check_mixer(
    intermediate_size: int, n_groups: int, d_state: int, num_heads: int, tp_size: int
) -> None:
    """The configurations MambaMixer2.__init__ (vLLM 0.21.0) accepts."""
    _require_positive(
        intermediate_size=intermediate_size,
        n_groups=n_groups,
        d_state=d_state,
        num_heads=num_heads,
        tp_size=tp_size,
    )
    if num_heads % tp_size:
        raise ValueError(f"tp_size {tp_size} must divide num_heads {num_heads}")
    if intermediate_size % num_heads:
        raise ValueError(f"num_heads {num_heads} must divide intermediate_size {intermediate_size}")
    if n_groups % tp_size and n_groups != 1:
        raise ValueError(
            f"vLLM's Mamba2 mixer needs tp_size ({tp_size}) to divide n_groups "
            f"({n_groups}) or n_groups == 1"
        )


def _check_tp_pair(p_tp: int, d_tp: int, d_rank: int) -> None:
    _check_rank(d_tp, d_rank, side="decode ")
    _require_positive(p_tp=p_tp)
    if p_tp % d_tp and d_tp % p_tp:
        raise ValueError(f"one of p_tp {p_tp} and d_tp {d_tp} must divide the other")


# ----------------------------------------------------------------------------
# Layout of one rank (mirrors vLLM 0.21.0's Mamba2 mixer)
# ----------------------------------------------------------------------------


def padded_n_groups(n_groups: int, tp_size: int) -> int:
    """mamba_utils.py ``extra_groups_for_head_shards``: the group count vLLM allocates."""
    if n_groups % tp_size == 0:
        return n_groups
    return n_groups + (tp_size - n_groups)


def groups_replicated(n_groups: int, tp_size: int) -> bool:
    """True when ranks hold copies of the same group instead of disjoint shards."""
    return n_groups % tp_size != 0


def local_group_ids(n_groups: int, tp_size: int, tp_rank: int) -> range:
    """True (unpadded) groups whose B and C channels ``tp_rank`` holds, in order.

    Sharded (``tp`` divides ``n_groups``): MergedColumnParallelLinear gives shard
    ``tp_rank``. Replicated (``n_groups == 1``): ``mamba_v2_sharded_weight_loader`` uses
    ``rank = 0`` and ``take = d_state`` for every rank, so each holds group 0.
    """
    _check_rank(tp_size, tp_rank)
    if groups_replicated(n_groups, tp_size):
        if n_groups != 1:
            raise ValueError("vLLM only replicates groups when n_groups == 1")
        return range(0, 1)
    per_rank = n_groups // tp_size
    return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)


def _local_x_ids(intermediate_size: int, tp_size: int, tp_rank: int) -> range:
    per_rank = intermediate_size // tp_size
    return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)


def conv_channel_ids(
    intermediate_size: int,
    n_groups: int,
    d_state: int,
    num_heads: int,
    tp_size: int,
    tp_rank: int,
) -> npt.NDArray[np.int64]:
    """Global id of each local conv channel of ``tp_rank``, in conv-state order.

    x channel ``c`` -> ``c``; B of true group ``g``, state ``s`` ->
    ``intermediate_size + g*d_state + s``; C -> that plus ``n_groups*d_state``.
    Replicated groups give the same ids on different ranks.
    """
    _check_mixer(intermediate_size, n_groups, d_state, num_heads, tp_size)
    _check_rank(tp_size, tp_rank)
    x_ids = np.asarray(_local_x_ids(intermediate_size, tp_size, tp_rank), dtype=np.int64)
    groups = np.asarray(local_group_ids(n_groups, tp_size, tp_rank), dtype=np.int64)
    bc_flat = (groups[:, None] * d_state + np.arange(d_state, dtype=np.int64)[None, :]).ravel()
    b_ids = intermediate_size + bc_flat
    c_ids = intermediate_size + n_groups * d_state + bc_flat
    return np.concatenate([x_ids, b_ids, c_ids])


def ssm_head_ids(num_heads: int, tp_size: int, tp_rank: int) -> npt.NDArray[np.int64]:
    """Global heads of ``tp_rank``'s SSM state (mamba2_state_shape: heads always sharded)."""
    _require_positive(num_heads=num_heads)
    _check_rank(tp_size, tp_rank)
    if num_heads % tp_size:
        raise ValueError(f"tp_size {tp_size} must divide num_heads {num_heads}")
    per_rank = num_heads // tp_size
    return np.arange(tp_rank * per_rank, (tp_rank + 1) * per_rank, dtype=np.int64)


def conv_regions(
    intermediate_size: int,
    n_groups: int,
    d_state: int,
    num_heads: int,
    conv_rows: int,
    dtype_size: int,
    tp_size: int,
    tp_rank: int,
) -> dict[Component, StateRegion]:
    """x, B and C regions of ``tp_rank``'s conv state, in bytes."""
    _check_mixer(intermediate_size, n_groups, d_state, num_heads, tp_size)
    _require_positive(conv_rows=conv_rows, dtype_size=dtype_size)
    row_bytes = conv_rows * dtype_size
    x_ids = _local_x_ids(intermediate_size, tp_size, tp_rank)
    groups = local_group_ids(n_groups, tp_size, tp_rank)
    x_size_bytes = len(x_ids) * row_bytes
    bc_size_bytes = len(groups) * d_state * row_bytes
    bc_global_offset_bytes = groups.start * d_state * row_bytes
    return {
        "x": StateRegion("x", 0, x_ids.start * row_bytes, x_size_bytes),
        "B": StateRegion("B", x_size_bytes, bc_global_offset_bytes, bc_size_bytes),
        "C": StateRegion("C", x_size_bytes + bc_size_bytes, bc_global_offset_bytes, bc_size_bytes),
    }


def _ssm_region(num_heads: int, head_bytes: int, tp_size: int, tp_rank: int) -> StateRegion:
    heads = ssm_head_ids(num_heads, tp_size, tp_rank)
    return StateRegion("ssm", 0, int(heads[0]) * head_bytes, len(heads) * head_bytes)


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
    p_regions_by_rank: dict[int, dict[Component, StateRegion]],
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
    intermediate_size: int,
    n_groups: int,
    d_state: int,
    num_heads: int,
    conv_rows: int,
    dtype_size: int,
    p_tp: int,
    d_tp: int,
    d_rank: int,
) -> list[ReadSlice]:
    """Reads that fill decode rank ``d_rank``'s conv state with the right channels.

    Ordered by component (x, B, C), then by source rank. When ``P_TP > D_TP`` the
    local side of each component is cut into ``k`` chunks like
    ``_build_local_splits_from_plan`` does; where a region's byte size is not a
    multiple of ``k`` the chunks are uneven (see ``respects_vllm_local_splits``) and
    the connector must register these local descriptors itself.
    """
    _check_tp_pair(p_tp, d_tp, d_rank)
    shape = (intermediate_size, n_groups, d_state, num_heads, conv_rows, dtype_size)
    sources = source_p_ranks(p_tp, d_tp, d_rank)
    d_regions = conv_regions(*shape, d_tp, d_rank)
    p_regions_by_rank = {p: conv_regions(*shape, p_tp, p) for p in sources}
    return _plan_from_regions([d_regions[c] for c in CONV_COMPONENTS], p_regions_by_rank, sources)


def ssm_read_plan(
    num_heads: int, head_bytes: int, p_tp: int, d_tp: int, d_rank: int
) -> list[ReadSlice]:
    """Reads of the SSM state; offsets relative to the SSM state's start.

    ``head_bytes`` is one head's state: ``head_dim * d_state * ssm dtype size``.
    """
    _check_tp_pair(p_tp, d_tp, d_rank)
    _require_positive(head_bytes=head_bytes)
    sources = source_p_ranks(p_tp, d_tp, d_rank)
    d_region = _ssm_region(num_heads, head_bytes, d_tp, d_rank)
    p_regions: dict[int, dict[Component, StateRegion]] = {
        p: {"ssm": _ssm_region(num_heads, head_bytes, p_tp, p)} for p in sources
    }
    return _plan_from_regions([d_region], p_regions, sources)


def plan_by_p_rank(plan: Sequence[ReadSlice]) -> dict[int, list[ReadSlice]]:
    """Slices grouped per prefill rank, in plan order (one NIXL handle per rank)."""
    grouped: dict[int, list[ReadSlice]] = {}
    for read in plan:
        grouped.setdefault(read.p_rank, []).append(read)
    return grouped


# ----------------------------------------------------------------------------
# What stock vLLM 0.21.0 registers
# ----------------------------------------------------------------------------


def _stock_split_bytes(
    intermediate_size: int,
    n_groups: int,
    d_state: int,
    num_heads: int,
    conv_rows: int,
    dtype_size: int,
    d_tp: int,
) -> tuple[int, int]:
    """``MambaConvSplitInfo.x_bytes`` / ``b_bytes`` as ``derive_mamba_conv_split`` gives D."""
    _check_mixer(intermediate_size, n_groups, d_state, num_heads, d_tp)
    _require_positive(conv_rows=conv_rows, dtype_size=dtype_size)
    row_bytes = conv_rows * dtype_size
    conv_dim_local = (intermediate_size + 2 * padded_n_groups(n_groups, d_tp) * d_state) // d_tp
    groups_ss = (conv_dim_local * d_tp - intermediate_size) // 2
    x_bytes = intermediate_size // d_tp * row_bytes
    b_bytes = groups_ss // d_tp * row_bytes
    return x_bytes, b_bytes


def vllm_local_chunks(
    region_offsets: Sequence[tuple[int, int]], num_chunks: int, index: int
) -> list[tuple[int, int]]:
    """``_build_local_splits_from_plan``: chunk ``index`` of each (offset, size) region."""
    chunks = []
    for offset_bytes, size_bytes in region_offsets:
        chunk_bytes = size_bytes // num_chunks
        chunks.append((offset_bytes + index * chunk_bytes, chunk_bytes))
    return chunks


def stock_conv_read_plan(
    intermediate_size: int,
    n_groups: int,
    d_state: int,
    num_heads: int,
    conv_rows: int,
    dtype_size: int,
    p_tp: int,
    d_tp: int,
    d_rank: int,
) -> list[ReadSlice]:
    """The x/B/C reads stock vLLM 0.21.0 registers (``_build_mamba_remote`` + local side)."""
    _check_tp_pair(p_tp, d_tp, d_rank)
    x_bytes, b_bytes = _stock_split_bytes(
        intermediate_size, n_groups, d_state, num_heads, conv_rows, dtype_size, d_tp
    )
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
    return _pair_up(per_rank)


def _pair_up(
    per_rank: dict[int, tuple[list[tuple[int, int]], list[tuple[int, int]]]],
) -> list[ReadSlice]:
    """Zip remote and local descriptors (NIXL pairs them by index) into slices."""
    plan = []
    for component_index, component in enumerate(CONV_COMPONENTS):
        for p_rank, (remote, local) in per_rank.items():
            remote_offset_bytes, size_bytes = remote[component_index]
            local_offset_bytes, local_size_bytes = local[component_index]
            if local_size_bytes != size_bytes:
                raise ValueError(f"stock descriptor sizes differ for {component}")
            plan.append(
                ReadSlice(p_rank, component, remote_offset_bytes, local_offset_bytes, size_bytes)
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
        return [ReadSlice(sources[0], "ssm", rank_offset * d_ssm_bytes, 0, d_ssm_bytes)]
    plan = []
    for index, p_rank in enumerate(sources):
        [(local_offset_bytes, local_size_bytes)] = vllm_local_chunks(
            [(0, d_ssm_bytes)], len(sources), index
        )
        if local_size_bytes != p_ssm_bytes:
            raise ValueError("stock SSM descriptor sizes differ")
        plan.append(ReadSlice(p_rank, "ssm", 0, local_offset_bytes, p_ssm_bytes))
    return plan


def respects_vllm_local_splits(
    plan: Sequence[ReadSlice],
    intermediate_size: int,
    n_groups: int,
    d_state: int,
    num_heads: int,
    conv_rows: int,
    dtype_size: int,
    p_tp: int,
    d_tp: int,
    d_rank: int,
) -> bool:
    """Whether ``plan``'s local side equals what vLLM registers locally.

    True means an override only has to change the remote descriptors; False (a
    replicated B/C region whose byte size is not a multiple of ``P_TP // D_TP``)
    means it must register the plan's local descriptors too.
    """
    stock = stock_conv_read_plan(
        intermediate_size, n_groups, d_state, num_heads, conv_rows, dtype_size, p_tp, d_tp, d_rank
    )
    local = [(r.p_rank, r.component, r.local_offset_bytes, r.size_bytes) for r in plan]
    stock_local = [(r.p_rank, r.component, r.local_offset_bytes, r.size_bytes) for r in stock]
    return local == stock_local


# ----------------------------------------------------------------------------
# Mamba2 dimensions of HF configs
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Mamba2Params:
    """The Mamba2 mixer dimensions the read plan needs (global, before TP)."""

    intermediate_size: int
    n_groups: int
    d_state: int
    num_heads: int


def _first_present(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def mamba2_params(hf_config: Any) -> Mamba2Params | None:
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
    return Mamba2Params(
        intermediate_size=int(intermediate_size),
        n_groups=int(n_groups),
        d_state=int(d_state),
        num_heads=int(num_heads),
    )
