"""Running check-harness cells for the vLLM 0.33 tests: one rank pool, results by key."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vllm_nixl_hma.harness import coordinator
from vllm_nixl_hma.harness.model_shapes import installed_layouts


def model_dirs(root: Path, names: Iterable[str] | None = None) -> dict[str, str]:
    """A model directory per embedded layout (the installed vLLM's configs)."""
    layouts = installed_layouts()
    return {name: coordinator.model_dir_for(layouts[name], root) for name in (names or layouts)}


def run_by_key(cells: dict[Any, coordinator.Cell], pool_size: int) -> dict[Any, list]:
    """Every cell on one pool of ``pool_size`` rank processes, in order; the
    scenario results of each, under the cell's key."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    pool = coordinator.RankPool(pool_size)
    try:
        return {
            key: coordinator.run_cell(pool, cell, progress=lambda line: None)
            for key, cell in cells.items()
        }
    finally:
        pool.close()
