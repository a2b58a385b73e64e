"""Pure block arithmetic: which remote kernel block feeds which local one.

No vLLM, no torch: numpy and the standard library only, so every rule here
is tested exhaustively and with hypothesis against a reference written in
token positions (tests/property/).

Terms (docs/design.md section 2):

* a *logical* block is what the scheduler hands out; one logical block ``L``
  of a side whose kernel-per-logical ratio is ``r`` is the kernel blocks
  ``L*r .. L*r + r - 1``;
* attention groups (full and sliding window) are expanded to kernel blocks,
  Mamba groups never are: one logical block is one state slot;
* *local* is the decode worker that reads, *remote* the prefill worker that
  is read from.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from vllm_nixl_hma.core.errors import BlockAlignmentError, IncompatibleRemoteError

__all__ = [
    "GroupKind",
    "KernelIds",
    "LogicalIds",
    "align_kernel_ids_by_group",
    "check_alignable",
    "check_group_count",
    "has_local_blocks",
    "logical_to_kernel_ids",
    "logical_to_kernel_ids_by_group",
]

LogicalIds = Sequence[int] | npt.NDArray[np.integer]
KernelIds = Sequence[int] | npt.NDArray[np.integer]


class GroupKind(enum.Enum):
    """Kind of one HMA KV cache group, as far as block arithmetic cares."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"

    @property
    def is_attention(self) -> bool:
        return self is not GroupKind.MAMBA


def has_local_blocks(block_ids_by_group: Sequence[LogicalIds]) -> bool:
    """Whether a request to receive has a block in any group. vLLM sends ones
    with none (no group, or only empty groups) just to tell prefill to free
    its blocks: nothing is read for them and nobody waits for them."""
    return any(len(group) > 0 for group in block_ids_by_group)


def logical_to_kernel_ids(
    logical_ids: LogicalIds, physical_per_logical: int
) -> npt.NDArray[np.int64]:
    """Expand logical block ids into kernel block ids of the SAME side.

    ``physical_per_logical`` is the ratio of the side that owns the ids: it is
    both the multiplier and the length of each expanded run. (vLLM 0.21.0
    used the remote ratio as multiplier and the local one as run length.)
    """
    if physical_per_logical < 1:
        raise ValueError(f"physical_per_logical must be >= 1, got {physical_per_logical}")
    logical = np.asarray(logical_ids, dtype=np.int64).reshape(-1, 1)
    if physical_per_logical == 1:
        return logical.reshape(-1)
    offsets = np.arange(physical_per_logical, dtype=np.int64)
    return (logical * physical_per_logical + offsets).reshape(-1)


def logical_to_kernel_ids_by_group(
    logical_ids_by_group: Sequence[LogicalIds],
    group_kinds: Sequence[GroupKind],
    physical_per_logical: int,
) -> list[npt.NDArray[np.int64]]:
    """Expand every attention group of one side; pass Mamba groups through."""
    if len(logical_ids_by_group) != len(group_kinds):
        raise BlockAlignmentError(
            "number of KV cache groups",
            len(group_kinds),
            len(logical_ids_by_group),
            "block ids must come with one list per KV cache group",
        )
    return [
        logical_to_kernel_ids(ids, physical_per_logical)
        if kind.is_attention
        else np.asarray(ids, dtype=np.int64).reshape(-1)
        for ids, kind in zip(logical_ids_by_group, group_kinds, strict=True)
    ]


def _pair_with_remote_tail(
    local_kernel_ids: npt.NDArray[np.int64],
    remote_kernel_ids: npt.NDArray[np.int64],
    group_index: int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Equal ratios: the local list is the remote list, or its tail after a
    local prefix-cache hit (or sliding-window clipping, which both sides do
    alike)."""
    local_count = len(local_kernel_ids)
    remote_count = len(remote_kernel_ids)
    if local_count > remote_count:
        raise BlockAlignmentError(
            f"kernel block count of group {group_index}",
            local_count,
            remote_count,
            "with equal kernel-per-logical ratios the decode side can only need "
            "fewer blocks than the prefill side sent (prefix-cache hit), never more",
        )
    return local_kernel_ids, remote_kernel_ids[remote_count - local_count :]


def _pair_leading(
    local_kernel_ids: npt.NDArray[np.int64],
    remote_kernel_ids: npt.NDArray[np.int64],
    group_index: int,
    max_physical_per_logical: int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Unequal ratios (prefix caching off): both lists start at token 0 and
    differ only by the rounding of the prompt up to whole logical blocks,
    which is padding at the END. Kernel block k pairs with kernel block k;
    the trailing surplus of the longer list is dropped."""
    local_count = len(local_kernel_ids)
    remote_count = len(remote_kernel_ids)
    if abs(local_count - remote_count) >= max_physical_per_logical:
        raise BlockAlignmentError(
            f"kernel block count of group {group_index}",
            local_count,
            remote_count,
            "rounding up to whole logical blocks explains a difference of less "
            f"than max(local, remote kernel-per-logical ratio) = "
            f"{max_physical_per_logical} kernel blocks only",
        )
    paired_count = min(local_count, remote_count)
    return local_kernel_ids[:paired_count], remote_kernel_ids[:paired_count]


def check_group_count(
    local_ids_by_group: Sequence[KernelIds],
    remote_ids_by_group: Sequence[KernelIds],
    group_kinds: Sequence[GroupKind],
) -> None:
    """Raise ``BlockAlignmentError`` unless both sides sent one list per group."""
    group_count = len(group_kinds)
    if len(local_ids_by_group) != group_count or len(remote_ids_by_group) != group_count:
        raise BlockAlignmentError(
            "number of KV cache groups",
            len(local_ids_by_group),
            len(remote_ids_by_group),
            f"both sides must send one block list per KV cache group ({group_count})",
        )


def align_kernel_ids_by_group(
    local_kernel_ids_by_group: Sequence[KernelIds],
    remote_kernel_ids_by_group: Sequence[KernelIds],
    group_kinds: Sequence[GroupKind],
    local_physical_per_logical: int,
    remote_physical_per_logical: int,
) -> tuple[list[npt.NDArray[np.int64]], list[npt.NDArray[np.int64]]]:
    """Pair local and remote kernel blocks group by group.

    Returns two lists of equal-length id arrays: element ``i`` of the local
    array of a group receives element ``i`` of the remote array.

    Rules (docs/design.md section 3):

    * Mamba groups: whole states, never expanded; counts must be equal.
    * Attention groups, ratios differ (a Mamba hybrid with heterogeneous TP,
      or engines started with different --block-size): pair leading blocks,
      drop the trailing rounding surplus; the counts may differ by less than
      ``max(local, remote ratio)``. ``check_alignable`` refuses prefix
      caching and sliding-window groups in that setup at handshake.
    * Attention groups, equal ratios: vLLM 0.21.0's rule, the local list
      pairs with the remote tail (after a local prefix-cache hit, or
      sliding-window clipping, which both sides do alike).

    An empty local list of groups (full local prefix-cache hit) is returned
    as is, with an empty remote list.
    """
    if len(local_kernel_ids_by_group) == 0:
        return [], []
    check_group_count(local_kernel_ids_by_group, remote_kernel_ids_by_group, group_kinds)
    pair_leading = local_physical_per_logical != remote_physical_per_logical
    max_physical_per_logical = max(local_physical_per_logical, remote_physical_per_logical)

    local_aligned: list[npt.NDArray[np.int64]] = []
    remote_aligned: list[npt.NDArray[np.int64]] = []
    for group_index, kind in enumerate(group_kinds):
        local_kernel_ids = np.asarray(
            local_kernel_ids_by_group[group_index], dtype=np.int64
        ).reshape(-1)
        remote_kernel_ids = np.asarray(
            remote_kernel_ids_by_group[group_index], dtype=np.int64
        ).reshape(-1)
        if kind is GroupKind.MAMBA:
            if len(local_kernel_ids) != len(remote_kernel_ids):
                raise BlockAlignmentError(
                    f"Mamba state block count of group {group_index}",
                    len(local_kernel_ids),
                    len(remote_kernel_ids),
                    "a Mamba group holds whole states: both sides must send "
                    "the same number of state blocks",
                )
            pair = (local_kernel_ids, remote_kernel_ids)
        elif pair_leading:
            pair = _pair_leading(
                local_kernel_ids, remote_kernel_ids, group_index, max_physical_per_logical
            )
        else:
            pair = _pair_with_remote_tail(local_kernel_ids, remote_kernel_ids, group_index)
        local_aligned.append(pair[0])
        remote_aligned.append(pair[1])
    return local_aligned, remote_aligned


def align_kernel_id_lists(
    local_kernel_ids_by_group: Sequence[KernelIds],
    remote_kernel_ids_by_group: Sequence[KernelIds],
    group_kinds: Sequence[GroupKind],
    local_physical_per_logical: int,
    remote_physical_per_logical: int,
) -> tuple[list[list[int]], list[list[int]]]:
    """``align_kernel_ids_by_group`` as the lists of ints vLLM's read path
    takes (both releases' ``_apply_prefix_caching``)."""
    local_aligned, remote_aligned = align_kernel_ids_by_group(
        local_kernel_ids_by_group,
        remote_kernel_ids_by_group,
        group_kinds,
        local_physical_per_logical=local_physical_per_logical,
        remote_physical_per_logical=remote_physical_per_logical,
    )
    return [ids.tolist() for ids in local_aligned], [ids.tolist() for ids in remote_aligned]


def check_alignable(
    group_kinds: Sequence[GroupKind],
    local_physical_per_logical: int,
    remote_physical_per_logical: int,
    local_prefix_caching: bool,
    pairs_by_position: bool = False,
) -> None:
    """Refuse, at handshake, a pairing that ``align_kernel_ids_by_group``
    could not do from block counts alone.

    Only unequal ratios are constrained: a local prefix-cache hit or a
    sliding-window clip removes leading blocks, which the leading-block rule
    would then misalign. The config hook turns prefix caching off for Mamba
    hybrids unless the operator opted in, so this fires there only if the
    hook was bypassed; a dense model served with a different --block-size on
    each side meets it too. ``pairs_by_position``: decode pairs by the token
    positions its scheduler hands over (``positions``, the opt-in), which a
    prefix-cache hit does not confuse; sliding-window groups stay refused.
    """
    for name, value in (
        ("local_physical_per_logical", local_physical_per_logical),
        ("remote_physical_per_logical", remote_physical_per_logical),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise IncompatibleRemoteError(
                name,
                local_physical_per_logical,
                remote_physical_per_logical,
                "a kernel-per-logical ratio is a positive integer",
            )
    if local_physical_per_logical == remote_physical_per_logical:
        return
    if local_prefix_caching and not pairs_by_position:
        raise IncompatibleRemoteError(
            "physical_blocks_per_logical_kv_block",
            local_physical_per_logical,
            remote_physical_per_logical,
            "prefix caching is on, and with unequal kernel-per-logical ratios "
            "kernel blocks cannot be aligned after a prefix-cache hit; restart "
            "both engines with --no-enable-prefix-caching, or give them equal "
            "ratios (the same tensor-parallel size and --block-size), which keep "
            "prefix caching",
        )
    if GroupKind.SLIDING_WINDOW in group_kinds:
        raise IncompatibleRemoteError(
            "physical_blocks_per_logical_kv_block",
            local_physical_per_logical,
            remote_physical_per_logical,
            "sliding-window groups are clipped to whole logical blocks of "
            "different sizes on the two sides and cannot be aligned; run prefill "
            "and decode with the same tensor-parallel size and --block-size",
        )
