"""How long NIXL's progress thread waits for UCX between polls (no vLLM import).

NIXL's Python API (``nixl_agent``, 1.x) builds every agent with
``pthrDelay = 0``: the UCX backend's shared progress thread then polls its
workers with a zero timeout, for as long as the agent lives. Each vLLM NIXL
worker has one agent, so each engine worker keeps a core busy even while it
serves nothing (measured on the 2-core CI host: 100% of a core per idle agent
as vLLM 0.21.0 builds it; 2% with a delay of 100 us or more, which NIXL
rounds up to a 1 ms poll timeout). On a GPU server with a core to spare per
worker that costs little. On a small host running several engines, the
spinning threads starve everything else there: prefill's side-channel
listener and decode's handshake thread, so a first handshake outlasted
``side_channel_timeout_s`` and the request failed closed (seen in CI through
real engines, docs/measurements.md).

With a delay the thread blocks in ``poll`` on the UCX workers' event file
descriptors for at most that long (NIXL rounds it up to whole milliseconds,
at least 1 ms), so UCX events still wake it at once. The delay is set with
``progress_thread_delay_us`` in ``kv_connector_extra_config``; absent,
agents are built as NIXL builds them. NIXL's Python API has no parameter
for it, so ``agents_built_with_delay`` sets it on the configuration NIXL
passes to its bindings, while the agent is built.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping

from vllm_nixl_hma.core.config_values import whole_number
from vllm_nixl_hma.core.upstream_contract import names_swapped

__all__ = ["EXTRA_CONFIG_KEY", "MAX_DELAY_US", "agents_built_with_delay", "delay_us_from"]

#: kv_connector_extra_config key (NIXL's ``nixlAgentConfig.pthrDelay``, in us)
EXTRA_CONFIG_KEY = "progress_thread_delay_us"
#: a second: longer waits would only delay what UCX does not signal by an event
MAX_DELAY_US = 1_000_000


def delay_us_from(extra_config: Mapping[str, object] | None) -> int | None:
    """``progress_thread_delay_us`` from ``kv_connector_extra_config``: a
    whole number of microseconds from 0 to ``MAX_DELAY_US``, or ``None``
    when absent (NIXL's own: 0, polling without pause).

    Raises ``ValueError`` naming the key and the value for anything else
    (a bool, a fraction, text that is not a number, out of range).
    """
    value = (extra_config or {}).get(EXTRA_CONFIG_KEY)
    if value is None:
        return None
    delay_us = whole_number(value)
    if delay_us is None or not 0 <= delay_us <= MAX_DELAY_US:
        raise ValueError(
            f"kv_connector_extra_config {EXTRA_CONFIG_KEY}={value!r}: expected a whole "
            f"number of microseconds from 0 to {MAX_DELAY_US} (absent: NIXL's own, 0, "
            "a progress thread that never pauses)"
        )
    return delay_us


@contextlib.contextmanager
def agents_built_with_delay(agent_cls: type, delay_us: int | None) -> Iterator[bool]:
    """While the block runs, NIXL agents of ``agent_cls`` (NIXL's
    ``nixl_agent``) are built with a progress-thread delay of ``delay_us``.

    Yields whether it could: ``False`` with ``delay_us`` None, and for a
    class whose module builds agents through no ``nixlBind.nixlAgent``
    (stand-ins, such as vLLM's own tests use), which are then built as
    asked. The bindings' ``nixlAgent`` is put back on every exit.
    """
    bindings = getattr(sys.modules.get(getattr(agent_cls, "__module__", "")), "nixlBind", None)
    build = getattr(bindings, "nixlAgent", None)
    if delay_us is None or build is None:
        yield False
        return

    def build_with_delay(name, config, *args, **kwargs):
        config.pthrDelay = delay_us
        return build(name, config, *args, **kwargs)

    with names_swapped(bindings, {"nixlAgent": build_with_delay}):
        yield True
