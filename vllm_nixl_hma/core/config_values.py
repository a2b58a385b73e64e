"""Reading numbers from ``kv_connector_extra_config`` (no vLLM import).

The extra config is JSON from the command line, so a number may come as a
number or as text; a bool is JSON's ``true``, never a count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = [
    "MAMBA_PREFIX_CACHING_KEY",
    "mamba_prefix_caching",
    "seconds_or_null",
    "whole_number",
]


def whole_number(value: object) -> int | None:
    """``value`` as an int when it is one (not a bool) or text of digits
    (surrounding spaces allowed); ``None`` for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def seconds_or_null(
    extra_config: Mapping[str, object] | None, key: str, default: float, null_means: str
) -> float | None:
    """``key`` of ``kv_connector_extra_config`` as a positive, finite number of
    seconds; ``None`` where it is ``null``; ``default`` where absent.
    ValueError naming the key, the value and what ``null`` means otherwise
    (the config is the operator's, read at start)."""
    value = (extra_config or {}).get(key, default)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not value > 0
    ):
        raise ValueError(
            f"kv_connector_extra_config {key}={value!r}: expected a positive number of "
            f"seconds, or null {null_means}"
        )
    return float(value)


#: ``kv_connector_extra_config`` key that keeps prefix caching on for a Mamba
#: hybrid in P/D (docs/design.md section 7)
MAMBA_PREFIX_CACHING_KEY = "mamba_prefix_caching"


def mamba_prefix_caching(extra_config: object) -> bool | None:
    """The operator's word on prefix caching of a Mamba hybrid in P/D:
    ``true`` or ``false`` (JSON, or that text), ``None`` when the key is
    absent. ValueError naming the key and the value for anything else."""
    config = extra_config if isinstance(extra_config, dict) else {}
    if MAMBA_PREFIX_CACHING_KEY not in config:
        return None
    value = config[MAMBA_PREFIX_CACHING_KEY]
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if isinstance(value, bool):
        return value
    raise ValueError(
        f"kv_connector_extra_config {MAMBA_PREFIX_CACHING_KEY!r} must be true or false, "
        f"got {value!r}"
    )
