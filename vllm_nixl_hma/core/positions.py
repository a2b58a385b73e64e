"""Pure block arithmetic for prefix caching in P/D: pair kernel blocks by the
token positions they hold.

No vLLM, no torch. ``blocks.align_kernel_ids_by_group`` pairs lists from
their lengths alone, which is right when decode had no prefix-cache hit or
both sides round the prompt to logical blocks of one size. A decode-side hit
at unequal kernel-per-logical ratios (a Mamba hybrid at heterogeneous TP)
breaks both of its rules: decode's list starts at the hit, prefill's at token
0, and their lengths differ by rounding too, so no rule on lengths can tell
where decode's first block sits in prefill's list (docs/design.md section 7).
Decode's scheduler knows: it hands its workers a ``TokenSpan`` per request,
and this module pairs by it.

Rules, for a request whose decode side holds tokens ``[0, local_hit_tokens)``
already and reads ``[local_hit_tokens, prefill_tokens)`` from prefill
(kernel blocks of ``kernel_block_tokens`` tokens on both sides, which the
handshake checks):

* full attention: decode's kernel block ``j`` holds the tokens of kernel
  block ``local_hit_tokens / kernel_block_tokens + j`` of the prompt, and
  prefill's list covers the prompt from token 0, so it pairs with prefill's
  block of that index. Blocks past the prompt's last token are padding and
  are not read. Prefill's list must hold exactly the kernel blocks of
  ``cdiv(prefill_tokens, prefill logical block tokens)`` logical blocks.
* sliding window: at equal ratios both lists end at the same kernel block,
  so decode's list pairs with prefill's tail (vLLM 0.21.0's rule); at
  unequal ratios the handshake refuses them and so does this.
* Mamba: decode reads one state, prefill's state after ``prefill_tokens``
  tokens, into the one state block it allocated. Prefill's list holds one
  state block, or with prefix caching one block per logical block of which
  the last holds the running state (vLLM's ``align`` and ``all`` Mamba cache
  modes); vLLM's null block (id 0) is never a state.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from vllm_nixl_hma.core import config_values
from vllm_nixl_hma.core.blocks import GroupKind, KernelIds, check_group_count
from vllm_nixl_hma.core.errors import BlockAlignmentError

__all__ = [
    "METADATA_ATTR",
    "NULL_BLOCK_ID",
    "TokenSpan",
    "check_prefill_lists",
    "hold_spans",
    "pair_by_token_position",
    "pairs_by_position",
    "span_for_prompt",
    "worker_pairs_by_position",
]

#: vLLM's null block: never handed to a request, never holds KV or a state
NULL_BLOCK_ID = 0

#: attribute of the connector metadata with {request id: TokenSpan}, set by
#: decode's scheduler side for every request it hands over to receive
METADATA_ATTR = "vllm_nixl_hma_token_spans"


@dataclass(frozen=True)
class TokenSpan:
    """The prompt tokens of one request's read, as decode's scheduler saw them.

    ``local_hit_tokens``: tokens decode's own prefix cache holds (a multiple
    of decode's logical block tokens); ``prefill_tokens``: tokens prefill's
    blocks hold (the prompt, less the last token for a Mamba hybrid, whose
    decode recomputes it from the state).
    """

    local_hit_tokens: int
    prefill_tokens: int

    def check(self, local_logical_block_tokens: int) -> None:
        """Raise ``BlockAlignmentError`` unless the span is one vLLM can make."""
        for name, value in (
            ("local_hit_tokens", self.local_hit_tokens),
            ("prefill_tokens", self.prefill_tokens),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BlockAlignmentError(
                    name, value, None, "a token count is a non-negative integer"
                )
        if self.local_hit_tokens >= self.prefill_tokens:
            raise BlockAlignmentError(
                "local_hit_tokens",
                self.local_hit_tokens,
                self.prefill_tokens,
                "decode reads only when its prefix-cache hit is shorter than what prefill holds",
            )
        if self.local_hit_tokens % local_logical_block_tokens:
            raise BlockAlignmentError(
                "local_hit_tokens",
                self.local_hit_tokens,
                None,
                f"a prefix-cache hit is whole logical blocks of "
                f"{local_logical_block_tokens} tokens",
            )


def span_for_prompt(prefill_tokens: int, external_tokens: int) -> TokenSpan:
    """The span of a request whose prefill holds ``prefill_tokens`` tokens
    (vLLM's count: the prompt, less its last token on a Mamba hybrid) of
    which decode reads ``external_tokens``, the rest being its own hit."""
    return TokenSpan(prefill_tokens - external_tokens, prefill_tokens)


def hold_spans(
    held: dict[str, TokenSpan],
    handed: Mapping[str, TokenSpan] | None,
    receiving: Container[str],
    in_flight: Container[str],
) -> None:
    """A decode worker's spans (both releases' ``start_load_kv``): those of
    requests no longer ``in_flight`` (upstream's receive metadata: finished,
    failed, or refused at handshake) are dropped, and of the spans the
    scheduler side ``handed`` over, those of requests ``receiving`` now are
    kept (a request whose ticket was refused is not received)."""
    for request_id in [r for r in held if r not in in_flight]:
        del held[request_id]
    if handed:
        held.update((r, span) for r, span in handed.items() if r in receiving)


def pairs_by_position(
    choice: bool | None, prefix_caching: bool, group_kinds: Sequence[GroupKind]
) -> bool:
    """Whether a decode worker pairs by token span (both releases): the
    operator's ``mamba_prefix_caching`` when given (``choice``), else for a
    Mamba hybrid with prefix caching on. A dense model keeps the count rules,
    which are right at equal ratios, unless the operator asks."""
    if choice is not None:
        return choice
    return prefix_caching and GroupKind.MAMBA in group_kinds


def worker_pairs_by_position(worker: object) -> bool:
    """``pairs_by_position`` for a decode worker of either release, read from
    its ``kv_transfer_config``, ``vllm_config.cache_config`` and
    ``_group_kinds``. Workers built bare (vLLM's own tests, the read-path
    harness) may lack the configs; they pair by counts, and their group
    kinds are not asked for."""
    transfer_config = getattr(worker, "kv_transfer_config", None)
    cache_config = getattr(getattr(worker, "vllm_config", None), "cache_config", None)
    choice = config_values.mamba_prefix_caching(
        getattr(transfer_config, "kv_connector_extra_config", None)
    )
    caching = bool(getattr(cache_config, "enable_prefix_caching", False))
    if choice is None and not caching:
        return False
    return pairs_by_position(choice, caching, worker._group_kinds)  # type: ignore[attr-defined]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _logical_blocks_sent(
    kind: GroupKind, window_tokens: int, prefill_tokens: int, remote_logical_block_tokens: int
) -> tuple[int, ...]:
    """The logical block counts a genuine prefill sends for one attention
    group of a request whose prefill holds ``prefill_tokens`` tokens: every
    block from token 0; for a sliding-window group also that list clipped to
    its last ``cdiv(window, block) + 1`` blocks, as vLLM's prefill does with
    the hybrid KV cache manager on (``get_sw_clipped_blocks``, 0.21 and 0.33)."""
    whole = _cdiv(prefill_tokens, remote_logical_block_tokens)
    if kind is not GroupKind.SLIDING_WINDOW or window_tokens <= 0:
        return (whole,)
    clipped = min(whole, _cdiv(window_tokens, remote_logical_block_tokens) + 1)
    return (whole,) if clipped == whole else (clipped, whole)


def check_prefill_lists(
    remote_kernel_ids_by_group: Sequence[KernelIds],
    group_kinds: Sequence[GroupKind],
    windows_tokens: Sequence[int],
    span: TokenSpan,
    remote_kernel_block_tokens: int,
    remote_physical_per_logical: int,
) -> None:
    """Raise ``BlockAlignmentError`` unless prefill's list of every attention
    group is as long as the list prefill holds for the span's prompt.

    Decode knows its prompt, so it knows how many tokens prefill computed
    (``span.prefill_tokens``) and how long each of prefill's lists must be
    (``_logical_blocks_sent``, in kernel ids at prefill's ratio). Pairing by
    counts cannot tell a list cut short from a decode that needs few blocks:
    an every-layer sliding window shorter than a block leaves decode one
    block to read, and any list of one block pairs with it (issue #41).
    Mamba groups hold states, not tokens, and are checked where they pair;
    an empty list is a prefill rank that is no source of its group.
    """
    if remote_kernel_block_tokens < 1 or remote_physical_per_logical < 1:
        raise BlockAlignmentError(
            "remote kernel block tokens / physical_per_logical",
            None,
            (remote_kernel_block_tokens, remote_physical_per_logical),
            "block sizes are positive",
        )
    if len(remote_kernel_ids_by_group) != len(group_kinds) or len(windows_tokens) != len(
        group_kinds
    ):
        raise BlockAlignmentError(
            "number of KV cache groups",
            len(group_kinds),
            len(remote_kernel_ids_by_group),
            f"prefill sends one block list per KV cache group ({len(group_kinds)}), "
            f"and decode knows {len(windows_tokens)} windows",
        )
    logical_block_tokens = remote_kernel_block_tokens * remote_physical_per_logical
    for group_index, kind in enumerate(group_kinds):
        sent = len(remote_kernel_ids_by_group[group_index])
        if kind is GroupKind.MAMBA or sent == 0:
            continue
        expected = tuple(
            count * remote_physical_per_logical
            for count in _logical_blocks_sent(
                kind, windows_tokens[group_index], span.prefill_tokens, logical_block_tokens
            )
        )
        if sent not in expected:
            raise BlockAlignmentError(
                f"prefill kernel block count of group {group_index}",
                " or ".join(str(count) for count in expected),
                sent,
                f"prefill holds {span.prefill_tokens} tokens from token 0 in logical "
                f"blocks of {logical_block_tokens} tokens"
                + (
                    f", and sends a window of {windows_tokens[group_index]} tokens whole or clipped"
                    if len(expected) > 1
                    else ""
                ),
            )


def _pair_full_attention(
    local: npt.NDArray[np.int64],
    remote: npt.NDArray[np.int64],
    group_index: int,
    span: TokenSpan,
    kernel_block_tokens: int,
    remote_physical_per_logical: int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    prompt_kernel_blocks = _cdiv(span.prefill_tokens, kernel_block_tokens)
    remote_expected = (
        _cdiv(span.prefill_tokens, kernel_block_tokens * remote_physical_per_logical)
        * remote_physical_per_logical
    )
    if len(remote) != remote_expected:
        raise BlockAlignmentError(
            f"prefill kernel block count of group {group_index}",
            len(local),
            len(remote),
            f"prefill holds {span.prefill_tokens} tokens from token 0, which is "
            f"{remote_expected} kernel blocks at its kernel-per-logical ratio "
            f"{remote_physical_per_logical}",
        )
    first = span.local_hit_tokens // kernel_block_tokens
    needed = prompt_kernel_blocks - first
    if len(local) < needed:
        raise BlockAlignmentError(
            f"decode kernel block count of group {group_index}",
            len(local),
            len(remote),
            f"decode reads tokens {span.local_hit_tokens}..{span.prefill_tokens - 1}, "
            f"{needed} kernel blocks, but allocated fewer",
        )
    return local[:needed], remote[first:prompt_kernel_blocks]


def _pair_mamba(
    local: npt.NDArray[np.int64],
    remote: npt.NDArray[np.int64],
    group_index: int,
    span: TokenSpan,
    remote_logical_block_tokens: int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    if len(local) != 1:
        raise BlockAlignmentError(
            f"decode Mamba state block count of group {group_index}",
            len(local),
            len(remote),
            "decode receives one state into one block (vLLM 0.21.0 and 0.33 hand a "
            "request whose KV arrives one real Mamba block in every cache mode); more "
            "would hold states at block boundaries nothing sent",
        )
    per_block = _cdiv(span.prefill_tokens, remote_logical_block_tokens)
    if len(remote) not in (1, per_block):
        raise BlockAlignmentError(
            f"prefill Mamba state block count of group {group_index}",
            len(local),
            len(remote),
            f"prefill holds one state block, or one per logical block of its "
            f"{span.prefill_tokens} tokens ({per_block})",
        )
    state = remote[-1:]
    if int(state[0]) == NULL_BLOCK_ID:
        raise BlockAlignmentError(
            f"prefill Mamba state block of group {group_index}",
            local.tolist(),
            remote.tolist(),
            "the last block holds prefill's running state and cannot be vLLM's null block",
        )
    return local, state


def pair_by_token_position(
    local_kernel_ids_by_group: Sequence[KernelIds],
    remote_kernel_ids_by_group: Sequence[KernelIds],
    group_kinds: Sequence[GroupKind],
    span: TokenSpan,
    kernel_block_tokens: int,
    local_physical_per_logical: int,
    remote_physical_per_logical: int,
) -> tuple[list[npt.NDArray[np.int64]], list[npt.NDArray[np.int64]]]:
    """Pair local and remote kernel blocks group by group by token position
    (the module docstring's rules). Returns two lists of equal-length id
    arrays: element ``i`` of a local array receives element ``i`` of the
    remote one. Raises ``BlockAlignmentError`` for lists no prompt of the
    span explains."""
    if kernel_block_tokens < 1 or local_physical_per_logical < 1 or remote_physical_per_logical < 1:
        raise BlockAlignmentError(
            "kernel_block_tokens / physical_per_logical",
            (kernel_block_tokens, local_physical_per_logical),
            remote_physical_per_logical,
            "block sizes are positive",
        )
    span.check(kernel_block_tokens * local_physical_per_logical)
    if len(local_kernel_ids_by_group) == 0:
        return [], []
    check_group_count(local_kernel_ids_by_group, remote_kernel_ids_by_group, group_kinds)
    equal_ratios = local_physical_per_logical == remote_physical_per_logical
    local_out: list[npt.NDArray[np.int64]] = []
    remote_out: list[npt.NDArray[np.int64]] = []
    for group_index, kind in enumerate(group_kinds):
        local = np.asarray(local_kernel_ids_by_group[group_index], dtype=np.int64).reshape(-1)
        remote = np.asarray(remote_kernel_ids_by_group[group_index], dtype=np.int64).reshape(-1)
        if len(local) == 0 and len(remote) == 0:
            # a remote rank that is no source of this group (vLLM's TP mapping)
            pair = (local, remote)
        elif kind is GroupKind.MAMBA:
            pair = _pair_mamba(
                local,
                remote,
                group_index,
                span,
                kernel_block_tokens * remote_physical_per_logical,
            )
        elif kind is GroupKind.FULL_ATTENTION:
            pair = _pair_full_attention(
                local, remote, group_index, span, kernel_block_tokens, remote_physical_per_logical
            )
        elif equal_ratios:
            if len(local) > len(remote):
                raise BlockAlignmentError(
                    f"kernel block count of group {group_index}",
                    len(local),
                    len(remote),
                    "a sliding-window list of decode ends where prefill's does and "
                    "cannot be the longer one",
                )
            pair = (local, remote[len(remote) - len(local) :])
        else:
            raise BlockAlignmentError(
                "physical_blocks_per_logical_kv_block",
                local_physical_per_logical,
                remote_physical_per_logical,
                f"sliding-window group {group_index} cannot be paired across unequal ratios",
            )
        local_out.append(pair[0])
        remote_out.append(pair[1])
    return local_out, remote_out
