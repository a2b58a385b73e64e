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


def run_desc_ids(run_ids: np.ndarray, num_layers: int, runs_per_layer: int) -> np.ndarray:
    """Descriptor ids of ``run_ids`` in every layer (layer-major)."""
    layer_first = np.arange(num_layers, dtype=np.int64)[:, None] * runs_per_layer
    return (layer_first + run_ids[None, :]).reshape(-1)


def mamba_desc_ids(
    logical_ids: np.ndarray, num_layers: int, logical_blocks: int, first_desc: int
) -> np.ndarray:
    """Descriptor ids of Mamba blocks in every region of every layer, for a
    list whose Mamba part starts at ``first_desc`` (vLLM's region-major order)."""
    regions = num_layers * MAMBA_REGIONS_PER_LAYER
    region_first = first_desc + np.arange(regions, dtype=np.int64)[:, None] * logical_blocks
    return (region_first + logical_ids[None, :]).reshape(-1)


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
