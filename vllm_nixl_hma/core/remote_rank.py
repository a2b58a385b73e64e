"""Which prefill rank a worker is adding: both releases' ``add_remote_agent``
know it, and the ``_build_mamba_remote`` it calls must, but upstream does not
pass it on. No vLLM import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["RemoteRankBeingAdded"]


class RemoteRankBeingAdded:
    """A mixin of both releases' workers: ``add_remote_agent`` runs upstream's
    inside ``_adding_remote_rank(rank)``, and ``_build_mamba_remote`` asks
    ``_remote_rank_being_added()``."""

    #: None outside add_remote_agent (also in a worker built without __init__)
    _remote_tp_rank_being_added: int | None = None

    @contextlib.contextmanager
    def _adding_remote_rank(self, remote_tp_rank: int) -> Iterator[None]:
        self._remote_tp_rank_being_added = remote_tp_rank
        try:
            yield
        finally:
            self._remote_tp_rank_being_added = None

    def _remote_rank_being_added(self) -> int:
        """The prefill rank being added; a RuntimeError outside
        ``add_remote_agent`` (upstream called ``_build_mamba_remote`` from
        somewhere else: its reads cannot be placed)."""
        rank = self._remote_tp_rank_being_added
        if rank is None:
            raise RuntimeError("_build_mamba_remote outside add_remote_agent")
        return rank
