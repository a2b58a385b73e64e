"""A multi-turn conversation for ``vllm-nixl-hma e2e --prefix-caching`` (#26).

Each turn resends the conversation so far (the previous turn's prompt and
the reference engine's answer to it) plus a new message, as a chat client
does. Turns are sized so that every prompt but its last token is whole
logical blocks of decode: what decode received for one turn (prefill's
state at that point, for a Mamba hybrid) is then a full block vLLM caches,
and the next turn can hit it on decode as well as on prefill.

What a turn cost is read from each engine's own /metrics (vLLM's counters),
before and after it: prefix-cache hit tokens on prefill and on decode, the
tokens decode's connector supplied (``external_prefix_cache_hits``) and the
bytes its NIXL reads moved. A control prompt, as long as the last turn but
of tokens no engine has seen, reads everything: the last turn must read
fewer bytes than it.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "TURNS",
    "Turn",
    "conversation_ok",
    "counter",
    "message_ids",
    "turn_message_lengths",
]

#: turns of the conversation (fewer when max_model_len does not hold them)
TURNS = 4


def turn_message_lengths(decode_block: int, answer_tokens: int, longest: int) -> list[int]:
    """Lengths of each turn's new message: the first ends one token past two
    decode blocks; each later one adds, with the answer before it, one decode
    block. ValueError when fewer than two turns fit in ``longest`` tokens."""
    first = 2 * decode_block + 1
    later = decode_block - answer_tokens
    if later < 1:
        raise ValueError(f"decode blocks of {decode_block} tokens hold no message after an answer")
    turns = min(TURNS, 1 + (longest - first) // decode_block) if longest >= first else 0
    if turns < 2:
        raise ValueError(
            f"decode blocks of {decode_block} tokens leave room for {turns} turn(s) in "
            f"{longest} tokens; a conversation needs 2"
        )
    return [first] + [later] * (turns - 1)


def message_ids(tag: str, length: int, vocab_size: int) -> list[int]:
    """Token ids of a message no other prompt of the run shares (seeded by ``tag``)."""
    rng = random.Random(f"conversation-{tag}-{length}")
    return [rng.randrange(3, vocab_size) for _ in range(length)]


def counter(metrics_text: str, name: str) -> float:
    """A vLLM counter summed over its label sets (0 when absent)."""
    pattern = re.compile(rf"^{re.escape(name)}_total(?:\{{[^}}]*\}})?\s+(\S+)$", re.M)
    return sum(float(value) for value in pattern.findall(metrics_text))


@dataclass
class Turn:
    """One turn as the report shows it (``turn`` 0: the control prompt)."""

    turn: int
    prompt_tokens: int
    match: bool = False
    http_status: int = 0
    error: str | None = None
    #: prefix-cache hit tokens of the prefill engines during the turn
    prefill_prefix_hit_tokens: int = 0
    #: prefix-cache hit tokens of decode (its own cache: not read from prefill)
    decode_prefix_hit_tokens: int = 0
    #: tokens decode's connector supplied (vLLM's external_prefix_cache_hits)
    decode_external_tokens: int = 0
    #: decode's logical blocks those tokens fill
    decode_blocks_read: int = 0
    #: bytes decode's NIXL reads moved (vLLM's nixl_bytes_transferred)
    decode_kv_bytes_read: int | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    def record_reads(self, decode_block: int) -> None:
        self.decode_blocks_read = math.ceil(self.decode_external_tokens / decode_block)


def conversation_ok(turns: list[Turn], control: Turn | None) -> bool:
    """Every turn and the control matched the reference with HTTP 200; a
    later turn hit prefill's cache and one hit decode's; and the last turn,
    after a decode-side hit, read fewer bytes than the control of its length."""
    if not turns or control is None:
        return False
    answered = all(t.match and t.http_status == 200 for t in [*turns, control])
    later = turns[1:]
    last = turns[-1]
    return (
        answered
        and any(t.prefill_prefix_hit_tokens > 0 for t in later)
        and any(t.decode_prefix_hit_tokens > 0 for t in later)
        and last.decode_prefix_hit_tokens > 0
        and last.decode_kv_bytes_read is not None
        and control.decode_kv_bytes_read is not None
        and 0 < last.decode_kv_bytes_read < control.decode_kv_bytes_read
        and last.decode_blocks_read < control.decode_blocks_read
    )
