"""The kind of each KV cache group, read from vLLM's specs (the same on vLLM 0.21 and 0.33).

The one piece of vLLM glue both releases' workers and the check harness share:
``blocks`` works on ``GroupKind`` values and never sees a vLLM class.
"""

from __future__ import annotations

from typing import Any

from vllm_nixl_hma.core import blocks

__all__ = ["group_kinds", "group_kinds_of", "group_windows"]


def group_kinds_of(kv_cache_config: Any) -> tuple[blocks.GroupKind, ...]:
    """The ``blocks.GroupKind`` of every KV cache group, in group order."""
    return group_kinds(kv_cache_config.kv_cache_groups)


def group_kinds(groups: Any) -> tuple[blocks.GroupKind, ...]:
    """The ``blocks.GroupKind`` of each of ``groups`` (``KVCacheGroupSpec``s;
    vLLM 0.33 moves blocks per ``kv_cache_config.transfer_groups``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import (
        get_representative_spec_type,
    )
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    kinds = []
    for group in groups:
        spec_type = get_representative_spec_type(group.kv_cache_spec)
        if issubclass(spec_type, MambaSpec):
            kinds.append(blocks.GroupKind.MAMBA)
        elif issubclass(spec_type, SlidingWindowSpec):
            kinds.append(blocks.GroupKind.SLIDING_WINDOW)
        else:
            kinds.append(blocks.GroupKind.FULL_ATTENTION)
    return tuple(kinds)


def group_windows(groups: Any) -> tuple[int, ...]:
    """The sliding window, in tokens, of each of ``groups``; 0 for a group
    without one. A group of several specs of one type (vLLM 0.33's
    ``UniformTypeKVCacheSpecs``) has the window of its specs, which vLLM
    groups only when they agree."""
    windows = []
    for group in groups:
        spec = group.kv_cache_spec
        specs = getattr(spec, "kv_cache_specs", None)
        if specs:
            spec = next(iter(specs.values()))
        windows.append(int(getattr(spec, "sliding_window", None) or 0))
    return tuple(windows)
