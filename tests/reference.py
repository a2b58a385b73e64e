"""An independent reference in token positions for block pairing.

It models what vLLM's schedulers hand the connector, not how the connector
computes: each side allocates logical blocks for a prompt of ``num_tokens``
tokens, scatters them over random physical ids, optionally drops a local
prefix-cache hit and clips sliding-window groups, and remembers for every
kernel block id which token positions it holds. A pairing of local and
remote kernel ids is then judged by positions alone:

* a paired local and remote kernel block hold the same token positions
  (so no padding block is paired with a real one);
* every local kernel block that holds a real token is paired exactly once;
* Mamba groups pair the request's one state slot with the remote's.

Nothing here imports vllm_nixl_hma.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

MAMBA = "mamba"
FULL = "full_attention"
SWA = "sliding_window"


@dataclass
class Side:
    """One engine's view of one request, as its scheduler sends it."""

    physical_per_logical: int
    kernel_block_tokens: int
    logical_ids_by_group: list[list[int]] = field(default_factory=list)
    #: per group: kernel id -> absolute kernel index in the sequence
    #: (kernel index i holds tokens [i*kernel_block_tokens, (i+1)*kernel_block_tokens))
    kernel_index_by_group: list[dict[int, int]] = field(default_factory=list)
    #: per group (Mamba only): the state slot id, else None
    state_id_by_group: list[int | None] = field(default_factory=list)

    @property
    def logical_block_tokens(self) -> int:
        return self.physical_per_logical * self.kernel_block_tokens


def sliding_window_logical_blocks(window_tokens: int, logical_block_tokens: int) -> int:
    """How many trailing logical blocks vLLM's NIXL scheduler keeps for a
    sliding-window group: enough for the window, plus one for the boundary."""
    return math.ceil(window_tokens / logical_block_tokens) + 1


def build_side(
    num_tokens: int,
    group_kinds: list[str],
    physical_per_logical: int,
    kernel_block_tokens: int,
    rng: random.Random,
    prefix_hit_logical_blocks: int = 0,
    window_tokens: int = 0,
    pool_logical_blocks: int = 4096,
) -> Side:
    """Allocate one request on one side and record what every block holds."""
    side = Side(physical_per_logical, kernel_block_tokens)
    logical_count = math.ceil(num_tokens / side.logical_block_tokens)
    # One block pool per side, as in HMA: no id is in two groups at once.
    needed = sum(1 if kind == MAMBA else logical_count for kind in group_kinds)
    # (block 0 is vLLM's null block: its pool never hands it to a request)
    free_ids = iter(rng.sample(range(1, max(pool_logical_blocks, needed + 1)), needed))
    for kind in group_kinds:
        if kind == MAMBA:
            state_id = next(free_ids)
            side.logical_ids_by_group.append([state_id])
            side.kernel_index_by_group.append({})
            side.state_id_by_group.append(state_id)
            continue
        physical = [next(free_ids) for _ in range(logical_count)]
        kept = list(range(prefix_hit_logical_blocks, logical_count))
        if kind == SWA:
            keep = sliding_window_logical_blocks(window_tokens, side.logical_block_tokens)
            kept = kept[-keep:]
        kernel_index: dict[int, int] = {}
        for logical_index in kept:
            for offset in range(physical_per_logical):
                kernel_id = physical[logical_index] * physical_per_logical + offset
                kernel_index[kernel_id] = logical_index * physical_per_logical + offset
        side.logical_ids_by_group.append([physical[i] for i in kept])
        side.kernel_index_by_group.append(kernel_index)
        side.state_id_by_group.append(None)
    return side


def pairing_errors(
    local: Side,
    remote: Side,
    num_tokens: int,
    local_kernel_ids_by_group: list[list[int]],
    remote_kernel_ids_by_group: list[list[int]],
) -> list[str]:
    """Every way the given pairing disagrees with token positions ([] = right)."""
    errors: list[str] = []
    if len(local_kernel_ids_by_group) != len(local.logical_ids_by_group) or len(
        remote_kernel_ids_by_group
    ) != len(local.logical_ids_by_group):
        return [
            f"group count: local {len(local_kernel_ids_by_group)}, "
            f"remote {len(remote_kernel_ids_by_group)}, "
            f"expected {len(local.logical_ids_by_group)}"
        ]
    real_kernel_blocks = math.ceil(num_tokens / local.kernel_block_tokens)
    for group, (local_ids, remote_ids) in enumerate(
        zip(local_kernel_ids_by_group, remote_kernel_ids_by_group, strict=True)
    ):
        local_ids = [int(i) for i in local_ids]
        remote_ids = [int(i) for i in remote_ids]
        if len(local_ids) != len(remote_ids):
            errors.append(f"group {group}: {len(local_ids)} local vs {len(remote_ids)} remote")
            continue
        if local.state_id_by_group[group] is not None:
            expected = [(local.state_id_by_group[group], remote.state_id_by_group[group])]
            if list(zip(local_ids, remote_ids, strict=True)) != expected:
                errors.append(f"group {group}: Mamba pairs {local_ids}->{remote_ids}")
            continue
        local_index = local.kernel_index_by_group[group]
        remote_index = remote.kernel_index_by_group[group]
        for local_id, remote_id in zip(local_ids, remote_ids, strict=True):
            if local_id not in local_index or remote_id not in remote_index:
                errors.append(f"group {group}: unknown kernel id {local_id} or {remote_id}")
            elif local_index[local_id] != remote_index[remote_id]:
                errors.append(
                    f"group {group}: local kernel index {local_index[local_id]} "
                    f"receives remote kernel index {remote_index[remote_id]}"
                )
        if len(set(local_ids)) != len(local_ids):
            errors.append(f"group {group}: a local kernel block is written twice")
        needed = {kid for kid, index in local_index.items() if index < real_kernel_blocks}
        missing = needed - set(local_ids)
        if missing:
            errors.append(
                f"group {group}: {len(missing)} local kernel blocks with real tokens "
                f"receive nothing (kernel indices "
                f"{sorted(local_index[k] for k in missing)[:8]})"
            )
    return errors
