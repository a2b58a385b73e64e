"""Descriptors per run of whole pages (pure arithmetic for the read path).

vLLM 0.21.0 registers one NIXL descriptor per kernel block per region, and
with a blocks-first layout (FlashInfer) two per page, K and V, so that
heterogeneous TP can read a slice of heads. When decode reads whole pages
(same TP on both sides, same kernel block size, same page bytes), the
``run_blocks`` kernel pages of an aligned run ``c`` (kernel ids
``c*run_blocks .. c*run_blocks + run_blocks - 1``, i.e. part of one logical
block on each side) are one contiguous byte range on both sides, and one
descriptor per (layer, run) moves the same bytes as ``2 * run_blocks`` (or
``run_blocks``) of vLLM's.

The run descriptor list of one side is: for each layer, one descriptor per
run of its pages; then, for hybrids, the Mamba descriptors exactly as vLLM
builds them (4 regions per layer: x, B, C, SSM; one entry per logical block).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: Mamba descriptor regions per layer in vLLM 0.21.0 (x, B, C conv slices; SSM state)
MAMBA_REGIONS_PER_LAYER = 4


def run_blocks_for(local_physical_per_logical: int, remote_physical_per_logical: int) -> int:
    """Kernel blocks per run: the largest count that starts every logical block on both sides."""
    return math.gcd(local_physical_per_logical, remote_physical_per_logical)


def page_run_descs(
    base_addrs: Sequence[int],
    page_bytes: Sequence[int],
    num_kernel_blocks: int,
    run_blocks: int,
    device_id: int,
) -> np.ndarray:
    """``(layers * runs_per_layer, 3)`` int64 rows ``(addr, bytes, device)``,
    layer-major: row ``layer * runs_per_layer + c`` covers kernel pages
    ``c*run_blocks .. c*run_blocks + run_blocks - 1`` of that layer."""
    runs_per_layer = num_kernel_blocks // run_blocks
    base = np.asarray(base_addrs, dtype=np.int64)[:, None]
    run_bytes = np.asarray(page_bytes, dtype=np.int64)[:, None] * run_blocks
    descs = np.empty((base.shape[0], runs_per_layer, 3), dtype=np.int64)
    descs[..., 0] = base + np.arange(runs_per_layer, dtype=np.int64)[None, :] * run_bytes
    descs[..., 1] = run_bytes
    descs[..., 2] = device_id
    return descs.reshape(-1, 3)


def run_ids_of(kernel_ids: np.ndarray, run_blocks: int) -> np.ndarray | None:
    """Run ids of a kernel-id list made of whole aligned runs, in order;
    ``None`` if it is not (a partial or misaligned run)."""
    if kernel_ids.size % run_blocks:
        return None
    rows = kernel_ids.reshape(-1, run_blocks)
    first = rows[:, 0]
    if np.any(first % run_blocks):
        return None
    if run_blocks > 1 and np.any(np.diff(rows, axis=1) != 1):
        return None
    return first // run_blocks


def whole_page_refusal(
    *,
    tp_ratio: int,
    block_size_ratio: int,
    local_page_bytes: Sequence[int],
    remote_page_bytes: Sequence[int],
    local_read_bytes_per_page: Sequence[int],
    descs_per_page: int,
    run_blocks: int,
) -> str | None:
    """Why runs of whole pages cannot replace vLLM's descriptors for this
    remote, or ``None`` when they can (and save descriptors)."""
    if tp_ratio != 1:
        return f"decode reads part of each page (tp_ratio {tp_ratio})"
    if block_size_ratio != 1:
        return f"kernel block sizes differ (block_size_ratio {block_size_ratio})"
    if list(local_page_bytes) != list(remote_page_bytes):
        return (
            f"page bytes differ (local {list(local_page_bytes)}, remote {list(remote_page_bytes)})"
        )
    if list(local_read_bytes_per_page) != list(local_page_bytes):
        return "vLLM's descriptors do not cover whole pages"
    if descs_per_page * run_blocks <= 1:
        return "one descriptor per page already"
    return None


def request_desc_ids(
    groups: Sequence[tuple[bool, np.ndarray]],
    *,
    run_blocks: int,
    num_layers: int,
    runs_per_layer: int,
    logical_blocks: int,
    buffer: np.ndarray | None = None,
) -> np.ndarray | None:
    """int32 descriptor ids of one side of a request in a run descriptor list.

    ``groups`` holds, per KV cache group, (is Mamba, block ids): kernel ids
    for attention groups, logical ids for Mamba groups. Attention groups give
    their runs in every layer, Mamba groups their blocks in every region, in
    group order. ``None`` when an attention list is not whole aligned runs.
    The result is a view of ``buffer`` when it is large enough (the caller
    may reuse it once NIXL has taken the ids), else of a new array; either
    way its ``base`` is the array to pass as ``buffer`` next time.
    """
    rows: list[tuple[np.ndarray, np.ndarray]] = []  # (first id per row, ids per row)
    for is_mamba, block_ids in groups:
        if is_mamba:
            regions = num_layers * MAMBA_REGIONS_PER_LAYER
            first = (
                num_layers * runs_per_layer + np.arange(regions, dtype=np.int64) * logical_blocks
            )
            rows.append((first, block_ids))
            continue
        run_ids = run_ids_of(block_ids, run_blocks)
        if run_ids is None:
            return None
        rows.append((np.arange(num_layers, dtype=np.int64) * runs_per_layer, run_ids))
    total = sum(first.size * ids.size for first, ids in rows)
    if buffer is None or buffer.size < total:
        buffer = np.empty(total, dtype=np.int32)
    out = buffer[:total]
    start = 0
    for first, ids in rows:
        size = first.size * ids.size
        np.add.outer(first, ids, out=out[start : start + size].reshape(first.size, ids.size))
        start += size
    return out
