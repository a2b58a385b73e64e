"""UCX settings the connector applies before NIXL builds its UCX backend (#43).

No vLLM import. NIXL's UCX backend reads UCX's configuration from the
environment when the worker builds its agent (``ucp_config_read``), so a
setting in ``os.environ`` before that applies to the agent, and one already
there is the operator's and is kept. ``apply`` sets each of ``DEFAULTS``
that the environment does not name, and returns what it did for the
worker's one startup line (``describe``).

``UCX_KEEPALIVE_INTERVAL`` (UCX's default: 20 s). Over UCX's TCP transport a
READ is UCX's software emulation: decode sends small GET requests, and
prefill's UCX worker answers with the data. Across hosts (network namespaces
on shaped links, ``docs/faults.md``, "Slow and stalled reads"), prefill's
kernel acknowledged decode's GET requests and then prefill's UCX worker sent
nothing for 10 to 20 s, not even its own keepalives; its answers left with
its next keepalive round. Why the worker stops is not known (#43 is open);
a short interval shortens most stalls but not all: with UCX's 20 s, 2 of 2
runs of CI's hybrid test had a read over 2 s (one given up at e2e's 20 s
``read_timeout_s``); with 100 ms, 2 of 6 (one of 10 s and one given up,
in the same run), the others' slowest about 1 to 1.5 s. A short interval also makes a peer
that went away noticed sooner. The cost: one message of about 66 bytes per
endpoint and interval (``UCX_KEEPALIVE_NUM_EPS`` endpoints per round, 128 by
default).
Remove when: the cause inside UCX or NIXL is found and fixed there.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass

__all__ = ["DEFAULTS", "Applied", "apply", "describe"]


@dataclass(frozen=True)
class Default:
    name: str
    value: str
    why: str


#: what the connector sets where the operator set nothing (module docstring)
DEFAULTS: tuple[Default, ...] = (
    Default(
        "UCX_KEEPALIVE_INTERVAL",
        "100ms",
        "a READ over UCX's TCP transport can wait in prefill's UCX until the next "
        "keepalive (UCX's default 20s)",
    ),
)


@dataclass(frozen=True)
class Applied:
    name: str
    value: str
    #: "plugin": set by ``apply``; "operator": the environment had it, kept
    source: str


def apply(environ: MutableMapping[str, str]) -> list[Applied]:
    """Set each of ``DEFAULTS`` that ``environ`` does not name; a name it has
    (whatever its value) is the operator's and is kept."""
    applied = []
    for default in DEFAULTS:
        if default.name in environ:
            applied.append(Applied(default.name, environ[default.name], "operator"))
        else:
            environ[default.name] = default.value
            applied.append(Applied(default.name, default.value, "plugin"))
    return applied


def describe(applied: list[Applied]) -> str:
    """The worker's startup line for what ``apply`` did."""
    parts = [
        f"{a.name}={a.value} ({'the plugin default' if a.source == 'plugin' else 'yours'})"
        for a in applied
    ]
    return (
        "NixlHMAConnector: UCX settings for NIXL's agent: "
        + ", ".join(parts)
        + "; a value set in the environment before the engine starts is kept "
        "(docs/faults.md, 'Slow and stalled reads')"
    )
