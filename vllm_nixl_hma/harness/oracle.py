"""The token oracle: what every KV slot must hold, and a count of those that do not.

Prefill writes into every slot of a request's blocks a code that encodes
what the slot holds: request, layer, K or V, token position, GLOBAL head and
channel for attention; request, layer, component and GLOBAL channel (or head)
for Mamba state. Replicated heads and SSM groups get the same code on every
rank, as in a real model. Decode poisons its whole cache first, and after the
transfer checks (a) every slot of its own token positions and its own
head/channel shard holds exactly the code prefill wrote for it and (b) every
page that belongs to no request is still poison.

Codes are bit patterns (slots are viewed as integers of the element size,
never compared as floats: random bits read as bf16 include NaNs). numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

K, V, CONV, SSM = 0, 1, 2, 3
POISON_16 = 0x7FBF  # a bf16 NaN bit pattern; never a code
POISON_32 = 0x7FBFFFFF

_INT_BY_ITEMSIZE = {2: np.int16, 4: np.int32}


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64 finaliser: every input bit flips about half the output bits."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def slot_codes(itemsize: int, *fields: npt.ArrayLike) -> npt.NDArray[np.integer]:
    """Code of every slot described by the broadcast of ``fields``.

    Fields are small non-negative integers (request, layer, component, ...).
    Returns signed integers of ``itemsize`` bytes, never the poison pattern.
    """
    with np.errstate(over="ignore"):
        acc = np.uint64(0x243F6A8885A308D3)
        for value in fields:
            acc = _mix(np.asarray(value, dtype=np.uint64) + acc * np.uint64(0x100000001B3))
    bits = 8 * itemsize
    codes = (acc & np.uint64((1 << bits) - 1)).astype(np.int64)
    poison = POISON_16 if itemsize == 2 else POISON_32
    codes = np.where(codes == poison, codes ^ 1, codes)
    codes = np.where(codes >= 1 << (bits - 1), codes - (1 << bits), codes)
    return codes.astype(_INT_BY_ITEMSIZE[itemsize])


def as_int_view(tensor) -> npt.NDArray[np.integer]:
    """A numpy integer view (same memory) of a CPU torch tensor."""
    import torch

    int_dtype = {2: torch.int16, 4: torch.int32}[tensor.element_size()]
    return tensor.view(int_dtype).numpy()


def poison_value(itemsize: int) -> int:
    return POISON_16 if itemsize == 2 else POISON_32 - (1 << 32)


@dataclass
class AttentionSlots:
    """One attention layer of one rank, as the oracle sees it."""

    layer_index: int
    group_index: int
    kv: npt.NDArray[np.integer]  # [kernel_blocks, 2, local_heads, kernel_block_tokens, head_size]
    global_heads: npt.NDArray[np.int64]


@dataclass
class MambaSlots:
    layer_index: int
    group_index: int
    conv: npt.NDArray[np.integer]  # [logical_blocks, conv_dim_local, conv_rows]
    ssm: npt.NDArray[np.integer]  # [logical_blocks, local_heads, ...]
    conv_channel_ids: npt.NDArray[np.int64]
    ssm_head_ids: npt.NDArray[np.int64]


@dataclass
class RequestBlocks:
    """One request on one side: logical ids per group, prompt length."""

    request_index: int
    num_tokens: int
    logical_ids_by_group: list[list[int]]
    #: its first tokens are request 0's (a prefill-side prefix-cache hit): their
    #: KV is request 0's, on prefill's shared pages and in decode's own
    shared_tokens: int = 0

    def code_request(self, position: int) -> int:
        """Whose KV the token at ``position`` is."""
        return 0 if position < self.shared_tokens else self.request_index


@dataclass
class CheckResult:
    slots_checked: int = 0
    mismatched_slots: int = 0
    pages_checked_poisoned: int = 0
    examples: list[str] = field(default_factory=list)
    #: request index -> mismatched slots of that request (-1: pages of no request)
    mismatched_by_request: dict[int, int] = field(default_factory=dict)

    def add(
        self, checked: int, mismatched: int, example: str | None, request_index: int = -1
    ) -> None:
        self.slots_checked += checked
        self.mismatched_slots += mismatched
        if mismatched:
            self.mismatched_by_request[request_index] = (
                self.mismatched_by_request.get(request_index, 0) + mismatched
            )
        if mismatched and example and len(self.examples) < 5:
            self.examples.append(example)


def attention_codes(
    slots: AttentionSlots, request_index: int, first_position: int, kernel_block_tokens: int
) -> npt.NDArray[np.integer]:
    """Codes for one kernel block whose first token is ``first_position``."""
    itemsize = slots.kv.dtype.itemsize
    kv = np.arange(2).reshape(2, 1, 1, 1)
    heads = slots.global_heads.reshape(1, -1, 1, 1)
    positions = (first_position + np.arange(kernel_block_tokens)).reshape(1, 1, -1, 1)
    channels = np.arange(slots.kv.shape[-1]).reshape(1, 1, 1, -1)
    return slot_codes(itemsize, request_index, slots.layer_index, kv, heads, positions, channels)


def mamba_codes(slots: MambaSlots, request_index: int):
    conv_shape = slots.conv.shape[1:]
    conv = slot_codes(
        slots.conv.dtype.itemsize,
        request_index,
        slots.layer_index,
        CONV,
        slots.conv_channel_ids.reshape(-1, 1),
        np.arange(conv_shape[1]).reshape(1, -1),
    )
    ssm_shape = slots.ssm.shape[1:]
    inner = np.arange(int(np.prod(ssm_shape[1:]))).reshape(1, -1)
    ssm = slot_codes(
        slots.ssm.dtype.itemsize,
        request_index,
        slots.layer_index,
        SSM,
        slots.ssm_head_ids.reshape(-1, 1),
        inner,
    ).reshape(ssm_shape)
    return conv, ssm


def kernel_blocks_of(logical_ids: list[int], physical_per_logical: int) -> list[tuple[int, int]]:
    """(kernel block id, index of the kernel block in the sequence) for a
    group's logical ids, which cover the sequence's trailing logical blocks
    when a sliding window clipped the leading ones."""
    return [
        (logical_id * physical_per_logical + offset, position * physical_per_logical + offset)
        for position, logical_id in enumerate(logical_ids)
        for offset in range(physical_per_logical)
    ]


def fill(
    attention: list[AttentionSlots],
    mamba: list[MambaSlots],
    requests: list[RequestBlocks],
    physical_per_logical: int,
    kernel_block_tokens: int,
    first_logical_index_by_group: list[list[int]] | None = None,
) -> None:
    """Prefill side: write every slot of every request's blocks."""
    for order, request in enumerate(requests):
        for slots in attention:
            logical_ids = request.logical_ids_by_group[slots.group_index]
            first_logical = (
                first_logical_index_by_group[order][slots.group_index]
                if first_logical_index_by_group
                else 0
            )
            for kernel_id, index in kernel_blocks_of(logical_ids, physical_per_logical):
                position = (first_logical * physical_per_logical + index) * kernel_block_tokens
                slots.kv[kernel_id] = attention_codes(
                    slots, request.code_request(position), position, kernel_block_tokens
                )
        for slots in mamba:
            (state_id,) = request.logical_ids_by_group[slots.group_index]
            conv, ssm = mamba_codes(slots, request.request_index)
            slots.conv[state_id] = conv
            slots.ssm[state_id] = ssm


def verify(
    attention: list[AttentionSlots],
    mamba: list[MambaSlots],
    requests: list[RequestBlocks],
    physical_per_logical: int,
    kernel_block_tokens: int,
    first_logical_index_by_group: list[list[int]],
    pages: npt.NDArray[np.integer] | None = None,
) -> CheckResult:
    """Decode side: check every slot that must hold data and every page that
    must not have been written. ``pages`` is the whole cache as
    [tensor, logical_block, elements] (None skips the poison check)."""
    result = CheckResult()
    used_pages: set[int] = set()
    for order, request in enumerate(requests):
        for slots in attention:
            group = slots.group_index
            logical_ids = request.logical_ids_by_group[group]
            used_pages.update(logical_ids)
            first_logical = first_logical_index_by_group[order][group]
            for kernel_id, index in kernel_blocks_of(logical_ids, physical_per_logical):
                position = (first_logical * physical_per_logical + index) * kernel_block_tokens
                real_tokens = min(kernel_block_tokens, request.num_tokens - position)
                if real_tokens <= 0:
                    continue  # rounding surplus: no token of the prompt lives here
                expected = attention_codes(
                    slots, request.code_request(position), position, kernel_block_tokens
                )[:, :, :real_tokens]
                actual = slots.kv[kernel_id][:, :, :real_tokens]
                wrong = int(np.count_nonzero(actual != expected))
                result.add(
                    expected.size,
                    wrong,
                    f"req {request.request_index} layer {slots.layer_index} kernel block "
                    f"{kernel_id} (tokens {position}..{position + real_tokens - 1}): "
                    f"{wrong} wrong",
                    request.request_index,
                )
        for slots in mamba:
            (state_id,) = request.logical_ids_by_group[slots.group_index]
            used_pages.add(state_id)
            conv, ssm = mamba_codes(slots, request.request_index)
            wrong_conv = int(np.count_nonzero(slots.conv[state_id] != conv))
            wrong_ssm = int(np.count_nonzero(slots.ssm[state_id] != ssm))
            result.add(
                conv.size,
                wrong_conv,
                f"req {request.request_index} layer {slots.layer_index} conv state: "
                f"{wrong_conv} wrong channels x rows",
                request.request_index,
            )
            result.add(
                ssm.size,
                wrong_ssm,
                f"req {request.request_index} layer {slots.layer_index} ssm state: "
                f"{wrong_ssm} wrong",
                request.request_index,
            )
    if pages is not None:
        poison = poison_value(pages.dtype.itemsize)
        for page in range(pages.shape[1]):
            if page in used_pages:
                continue
            wrong = int(np.count_nonzero(pages[:, page] != poison))
            result.pages_checked_poisoned += 1
            result.add(
                pages[:, page].size,
                wrong,
                f"page {page} belongs to no request but {wrong} slots were written",
            )
    return result


def poison(pages: npt.NDArray[np.integer]) -> None:
    pages[...] = poison_value(pages.dtype.itemsize)
