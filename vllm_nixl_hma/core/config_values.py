"""Reading numbers from ``kv_connector_extra_config`` (no vLLM import).

The extra config is JSON from the command line, so a number may come as a
number or as text; a bool is JSON's ``true``, never a count.
"""

from __future__ import annotations

__all__ = ["MAMBA_PREFIX_CACHING_KEY", "mamba_prefix_caching", "whole_number"]


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
