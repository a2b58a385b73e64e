"""What one rank's Mamba-type state is made of, from the model's config (vLLM 0.21 and 0.33).

``StateSplit`` stands in for upstream's ``MambaConvSplitInfo`` (``_conv_decomp``):
vLLM's describes the conv parts only by their per-rank byte sizes, so it
cannot tell a replicated SSM group from a sharded one; ours knows the model
(``mamba_conv.StateModel``), so the read plans of ``mamba_conv`` can place B
and C right. Both releases' workers build one per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_nixl_hma.core import mamba_conv
from vllm_nixl_hma.core.errors import IncompatibleRemoteError, UnsupportedModelError

__all__ = [
    "UPSTREAM_CONV_PARTS",
    "StateSplit",
    "derive_state_split",
    "RemoteStateReads",
    "remote_page_reads",
    "remote_state_reads",
    "state_sizes",
]

#: upstream's descriptor ids give each Mamba layer 4 regions: 3 conv parts + SSM
UPSTREAM_CONV_PARTS = 3


@dataclass(frozen=True)
class StateSplit:
    """What this rank's Mamba-type state is made of; stands in for upstream's
    ``MambaConvSplitInfo`` (``_conv_decomp``), which describes Mamba2 only.

    ``ssm_sizes`` is upstream's ``(conv state bytes, SSM state bytes)`` per
    block; ``local_conv_offsets`` is what upstream's ``_build_mamba_local``
    reads: (offset, size) in bytes of each conv part inside this rank's page.
    """

    model: mamba_conv.StateModel
    conv_rows: int
    conv_dtype_size: int
    ssm_head_bytes: int
    ssm_sizes: tuple[int, int]
    local_conv_offsets: list[tuple[int, int]]


def derive_state_split(vllm_config: Any, mamba_spec: Any, tp_size: int, tp_rank: int) -> StateSplit:
    """This rank's ``StateSplit``, from the model's config and checked against
    the ``MambaSpec`` shapes vLLM's layer reported (DS conv layout).

    Raises ``UnsupportedModelError`` for a state type ``mamba_conv`` does not
    describe, or a config whose dimensions do not give the spec's shapes.
    """
    import torch

    arch = vllm_config.model_config.architecture
    mamba_type = mamba_spec.mamba_type.name
    model = mamba_conv.state_model_of(vllm_config.model_config.hf_text_config, mamba_type)
    if model is None:
        raise UnsupportedModelError(
            f"NixlHMAConnector moves Mamba2 and GatedDeltaNet state; {arch} has "
            f"{mamba_type} layers, whose state it does not know how to split across TP ranks"
        )
    (conv_channels, conv_rows), ssm_shape = mamba_spec.shapes[0], mamba_spec.shapes[1]
    try:
        expected_channels = mamba_conv.conv_channel_ids(model, tp_size, tp_rank).size
        expected_heads = mamba_conv.ssm_head_ids(model.state_heads, tp_size, tp_rank).size
    except ValueError as e:
        raise UnsupportedModelError(f"{arch} at TP {tp_size}: {e}") from e
    if (expected_channels, expected_heads) != (conv_channels, ssm_shape[0]):
        raise UnsupportedModelError(
            f"{arch} at TP {tp_size}: its config gives {expected_channels} conv channels "
            f"and {expected_heads} state heads per rank, vLLM's layer has {conv_channels} "
            f"and {ssm_shape[0]} (state shapes {mamba_spec.shapes})"
        )
    conv_dtype_size = torch.empty(0, dtype=mamba_spec.dtypes[0]).element_size()
    ssm_head_bytes = (
        int(np.prod(ssm_shape[1:])) * torch.empty(0, dtype=mamba_spec.dtypes[1]).element_size()
    )
    regions = mamba_conv.conv_regions(model, conv_rows, conv_dtype_size, tp_size, tp_rank)
    if len(regions) != UPSTREAM_CONV_PARTS:
        raise UnsupportedModelError(f"{arch}: {len(regions)} conv parts, upstream reads 3")
    return StateSplit(
        model=model,
        conv_rows=int(conv_rows),
        conv_dtype_size=conv_dtype_size,
        ssm_head_bytes=ssm_head_bytes,
        ssm_sizes=(conv_channels * conv_rows * conv_dtype_size, ssm_shape[0] * ssm_head_bytes),
        local_conv_offsets=[(r.page_offset_bytes, r.size_bytes) for r in regions.values()],
    )


def state_sizes(split: StateSplit, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(conv state, SSM state) bytes per block of rank ``tp_rank`` of an engine
    of TP ``tp_size`` serving ``split``'s model: what that rank reports as
    vLLM's ``ssm_sizes``."""
    conv_bytes = sum(
        region.size_bytes
        for region in mamba_conv.conv_regions(
            split.model, split.conv_rows, split.conv_dtype_size, tp_size, tp_rank
        ).values()
    )
    heads = mamba_conv.ssm_head_ids(split.model.state_heads, tp_size, tp_rank).size
    return conv_bytes, int(heads) * split.ssm_head_bytes


def remote_page_reads(
    split: StateSplit,
    remote_tp_size: int,
    remote_rank: int,
    local_tp_size: int,
    local_rank: int,
    remote_conv_bytes_reported: int,
) -> list[tuple[int, int]]:
    """(offset, size) in bytes, inside one page of prefill rank ``remote_rank``,
    of what decode rank ``local_rank`` reads from it: the conv parts in part
    order, then the SSM state; one read each, as vLLM's local descriptors (each
    local part split evenly among the prefill ranks read) expect.

    ``remote_conv_bytes_reported`` is prefill's ``ssm_sizes[0]``; a value
    other than the model's conv state at prefill's TP size raises
    ``IncompatibleRemoteError``, as do TP sizes that split a replicated
    group's B/C unevenly.
    """
    remote_conv_bytes, _ = state_sizes(split, remote_tp_size, remote_rank)
    if int(remote_conv_bytes_reported) != remote_conv_bytes:
        raise IncompatibleRemoteError(
            "ssm_sizes[0] (conv state bytes per block of the prefill rank)",
            remote_conv_bytes,
            int(remote_conv_bytes_reported),
            "prefill's conv state is not the one this model has at its TP size; "
            "both engines must serve the same model",
        )
    shape = (split.model, split.conv_rows, split.conv_dtype_size)
    conv_plan = mamba_conv.conv_read_plan(*shape, remote_tp_size, local_tp_size, local_rank)
    if not mamba_conv.respects_vllm_local_splits(
        conv_plan, *shape, remote_tp_size, local_tp_size, local_rank
    ):
        raise IncompatibleRemoteError(
            "tensor_parallel_size",
            local_tp_size,
            remote_tp_size,
            "the replicated Mamba2 group's B/C conv state cannot be split evenly "
            "across the prefill ranks this decode rank reads; use TP sizes whose "
            "ratio divides d_state * (conv_kernel - 1) * dtype size",
        )
    ssm_plan = mamba_conv.ssm_read_plan(
        split.model.state_heads, split.ssm_head_bytes, remote_tp_size, local_tp_size, local_rank
    )
    conv_reads = [read for read in conv_plan if read.p_rank == remote_rank]
    ssm_reads = [read for read in ssm_plan if read.p_rank == remote_rank]
    if len(conv_reads) != UPSTREAM_CONV_PARTS or len(ssm_reads) != 1:
        raise RuntimeError(
            f"decode rank {local_rank} of TP {local_tp_size} reads no state "
            f"from prefill rank {remote_rank} of TP {remote_tp_size}"
        )
    reads = [(read.remote_offset_bytes, read.size_bytes) for read in conv_reads]
    reads.append((remote_conv_bytes + ssm_reads[0].remote_offset_bytes, ssm_reads[0].size_bytes))
    return reads


@dataclass(frozen=True)
class RemoteStateReads:
    """Where decode reads one prefill rank's Mamba state, in bytes, release
    by release only formatted differently: for each Mamba region of the
    prefill rank (its base address and the stride of one logical block's
    page), the (offset, size) reads inside a page, for each of
    ``num_logical_blocks`` pages."""

    reads: tuple[tuple[int, int], ...]
    #: (base address, bytes from one logical block's page to the next) per region
    regions: tuple[tuple[int, int], ...]
    num_logical_blocks: int

    def per_block(self, device_id: int) -> list[tuple[int, int, int]]:
        """vLLM 0.21's descriptor list: per region, each read for every
        block, as (address, size, device)."""
        return [
            (base_addr + block * page_stride + offset, size, device_id)
            for base_addr, page_stride in self.regions
            for offset, size in self.reads
            for block in range(self.num_logical_blocks)
        ]

    def strided(self, device_id: int) -> list[tuple[int, int, int, int, int]]:
        """vLLM 0.33's strided list: per region, each read as (first address,
        size, device, stride, count)."""
        return [
            (base_addr + offset, size, device_id, page_stride, self.num_logical_blocks)
            for base_addr, page_stride in self.regions
            for offset, size in self.reads
        ]


def remote_state_reads(
    split: StateSplit,
    *,
    remote_tp_size: int,
    remote_rank: int,
    local_tp_size: int,
    local_rank: int,
    remote_conv_bytes_reported: int,
    remote_num_kernel_blocks: int,
    remote_physical_per_logical: int,
    region_bases_and_kernel_strides: Sequence[tuple[int, int]],
) -> RemoteStateReads:
    """The reads of decode rank ``local_rank`` from prefill rank ``remote_rank``
    (``remote_page_reads``), placed in that rank's memory: a Mamba page
    spans ``remote_physical_per_logical`` kernel blocks of its region, so
    prefill has ``remote_num_kernel_blocks // remote_physical_per_logical``
    pages, each a kernel stride times the ratio from the next."""
    reads = remote_page_reads(
        split,
        remote_tp_size,
        remote_rank,
        local_tp_size,
        local_rank,
        remote_conv_bytes_reported,
    )
    return RemoteStateReads(
        reads=tuple(reads),
        regions=tuple(
            (int(base), int(kernel_stride) * remote_physical_per_logical)
            for base, kernel_stride in region_bases_and_kernel_strides
        ),
        num_logical_blocks=remote_num_kernel_blocks // remote_physical_per_logical,
    )
