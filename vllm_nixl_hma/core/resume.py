"""Where a request whose KV did not arrive may resume computing: pure block
arithmetic, no vLLM.

When a load fails under ``kv_load_failure_policy`` ``recompute``, vLLM's
scheduler keeps the request's tokens before its first invalid block as
computed and recomputes the rest. That is right when every token the next
forward pass attends to sits in a block the request holds. A sliding-window
group breaks it: vLLM allocates the window's blocks only and puts its null
block (id 0) in place of every block before the window, and decode reads
only the window. The first invalid block is then the window's first, and
resuming there makes attention read the null block for the window's start:
KV nobody computed (issue #41, docs/faults.md).

``holds_context`` says whether a resume point is sound for one KV cache
group. ``resume_tokens`` picks the point: the scheduler's own when sound, 0
otherwise. 0 is the only other sound point for a request whose null blocks
lead its list (vLLM's sliding-window and chunked-local managers only ever
put them there): any earlier point's window starts no later, so it needs
the same null blocks or more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from vllm_nixl_hma.core.positions import NULL_BLOCK_ID  # a block the request does not hold

__all__ = ["holds_context", "resume_tokens"]


def holds_context(
    block_ids: Sequence[int],
    skipped_tokens: int,
    resume_at_tokens: int,
    block_tokens: int,
) -> bool:
    """Whether a request resuming at token ``resume_at_tokens`` holds every
    block its attention reads: the blocks of tokens ``[skipped_tokens,
    resume_at_tokens)`` (``skipped_tokens``: what the group's attention no
    longer reads at that point, 0 for full attention), none of them the null
    block. Resuming at token 0 needs nothing."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if resume_at_tokens <= 0:
        return True
    first = min(skipped_tokens, resume_at_tokens) // block_tokens
    end = math.ceil(resume_at_tokens / block_tokens)
    if end > len(block_ids):
        return False
    return all(block_id != NULL_BLOCK_ID for block_id in block_ids[first:end])


def resume_tokens(
    block_ids: Sequence[int],
    skipped_tokens: int,
    resume_at_tokens: int,
    block_tokens: int,
) -> int:
    """The scheduler's resume point ``resume_at_tokens`` where the request
    holds its context (``holds_context``), else 0: recompute the prompt."""
    if holds_context(block_ids, skipped_tokens, resume_at_tokens, block_tokens):
        return resume_at_tokens
    return 0
