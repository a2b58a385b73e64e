"""Reading numbers from ``kv_connector_extra_config`` (no vLLM import).

The extra config is JSON from the command line, so a number may come as a
number or as text; a bool is JSON's ``true``, never a count.
"""

from __future__ import annotations

__all__ = ["whole_number"]


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
