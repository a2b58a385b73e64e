"""The 0.21.0 worker's failure reporting: what finished or failed, every
local block of a request it will not read reported to vLLM's scheduler,
dead or refused prefill engines released (``FailureReports``, a part of
``NixlHMAConnectorWorker``; docs/failure-paths.md lists every path).
"""

from __future__ import annotations

import functools
import threading

from vllm_nixl_hma._compat import require_adapter

require_adapter("v021", "vllm_nixl_hma.v021.failures")

from vllm.logger import init_logger  # noqa: E402

from vllm_nixl_hma.core import (  # noqa: E402
    blocks,
)
from vllm_nixl_hma.core.transfer_records import Reason  # noqa: E402

__all__ = ["FailedRequests", "FailureReports"]

logger = init_logger(f"vllm.{__name__}")


class FailedRequests(set):
    """Upstream's ``_failed_recv_reqs`` with a lock. vLLM's handshake thread
    adds to it (``request_ready``, when a handshake fails) while the engine's
    step reads and clears it in ``get_finished``; ``add`` waits while
    ``get_finished`` holds ``lock`` (reentrant: the step adds too)."""

    def __init__(self, *items):
        super().__init__(*items)
        self.lock = threading.RLock()

    def add(self, item) -> None:
        with self.lock:
            super().add(item)


class FailureReports:
    """Failure reporting of ``NixlHMAConnectorWorker`` (a mixin before vLLM's
    ``NixlConnectorWorker`` in its bases)."""

    def get_finished(self) -> tuple[set[str], set[str]]:
        """vLLM 0.21.0 ``NixlConnectorWorker.get_finished``.

        Why: upstream raises KeyError on a failed request whose remote engine
        never registered (refused or unreachable at handshake), and under HMA
        reports no invalid block for any failed request. What changes: each
        failed request, taken once from a snapshot of ``_failed_recv_reqs``
        (the handshake thread adds to it), has its blocks reported invalid;
        those of unregistered engines are removed from ``_failed_recv_reqs``
        and ``_recving_metadata`` before upstream runs and added to its
        ``done_recving``. All of it, upstream's part too, runs holding
        ``FailedRequests.lock``: a handshake that fails meanwhile waits to add
        its request, which the next call takes (without the lock, upstream
        met such a request unprepared and raised the KeyError anyway: twice
        in the fault test's dead-side-channel case). Remove when: upstream
        does both.
        """
        failed = self._failed_recv_reqs
        if not isinstance(failed, FailedRequests):  # a worker built without our constructor
            failed = self._failed_recv_reqs = FailedRequests(failed)
        with failed.lock:
            done_sending, done_recving, unregistered = self._get_finished_locked()
        self._release_failed_engines()
        return done_sending, done_recving | unregistered

    def _get_finished_locked(self) -> tuple[set[str], set[str], set[str]]:
        unregistered = set()
        # A failed request whose read from another remote rank is still in
        # flight is reported once that read ends (upstream's own pass then
        # reports it): reported now as well, it came back finished a second
        # time and upstream's "not found in recving_metadata" assert took the
        # engine down (unpairable lists on one rank of a TP 2 prefill).
        held = {
            rid: self._recving_metadata.get(rid)
            for rid in self._failed_recv_reqs
            if self._recving_transfers.get(rid)
        }
        self._failed_recv_reqs.difference_update(held)
        for request_id in tuple(self._failed_recv_reqs):
            if not self._kv_awaited(request_id):
                # the scheduler freed it already (see the ledger)
                self._failed_recv_reqs.discard(request_id)
                self._recving_metadata.pop(request_id, None)
                self._lease_deadlines.pop(request_id, None)
                self._refused_by_ticket.discard(request_id)
                continue
            self._report_invalid_blocks_of(request_id)
            self._lease_deadlines.pop(request_id, None)
            meta = self._recving_metadata.get(request_id)
            if (
                meta is None
                or meta.remote is None
                or request_id in self._refused_by_ticket  # its engine id is not trusted
                or not self._engine_registered(meta.remote.engine_id)
            ):
                unregistered.add(request_id)
        self._failed_recv_reqs.difference_update(unregistered)
        for request_id in unregistered:
            self._recving_metadata.pop(request_id, None)
            self._refused_by_ticket.discard(request_id)
        done_sending, done_recving = super().get_finished()
        for request_id, meta in held.items():
            if request_id in done_recving:  # its last read ended: failed now
                self._report_invalid_blocks_of(request_id, meta)
            else:
                self._failed_recv_reqs.add(request_id)
        return done_sending, done_recving, unregistered

    def _kv_awaited(self, request_id: str) -> bool:
        """Whether vLLM's scheduler waits for this request's KV: not for one
        with no local block in any group, sent only to notify prefill (see
        the ledger)."""
        meta = self._recving_metadata.get(request_id)
        return meta is not None and blocks.has_local_blocks(meta.local_block_ids)

    def _engine_registered(self, engine_id: str) -> bool:
        if self.transfer_topo is None:
            return False
        try:
            self.transfer_topo.get_engine_info(engine_id)
        except KeyError:
            return False
        return True

    def _handle_failed_transfer(self, req_id: str, handle: int):
        """vLLM 0.21.0 ``NixlConnectorWorker._handle_failed_transfer``, plus
        the request's blocks in every group under HMA and forgetting the
        failed engine (see the ledger)."""
        self._note_not_read(req_id, Reason.TRANSFER, "a posted NIXL read failed")
        self._report_invalid_blocks_of(req_id)
        super()._handle_failed_transfer(req_id, handle)
        meta = self._recving_metadata.get(req_id)
        if meta is not None and meta.remote is not None:
            self._forget_remote_engine(meta.remote.engine_id)

    def _forget_remote_engine(self, engine_id: str) -> None:
        """Mark a remote engine to be forgotten once nothing is in flight
        from it (see ``_release_failed_engines``)."""
        self.__dict__.setdefault("_failed_engine_ids", set()).add(engine_id)

    def _release_failed_engines(self) -> None:
        failed_engine_ids = self.__dict__.get("_failed_engine_ids")
        if not failed_engine_ids:
            return
        in_flight = {
            meta.remote.engine_id
            for request_id in self._recving_transfers
            if (meta := self._recving_metadata.get(request_id)) is not None
            and meta.remote is not None
        }
        for engine_id in tuple(failed_engine_ids - in_flight):
            failed_engine_ids.discard(engine_id)
            self._release_remote_engine(engine_id)

    def _release_remote_engine(self, engine_id: str) -> None:
        """Release what this worker holds for a remote engine, so that nothing
        leaks and the next request to it handshakes afresh."""
        with self._handshake_lock:
            for handle in self.dst_xfer_side_handles.pop(engine_id, {}).values():
                self.nixl_wrapper.release_dlist_handle(handle)
            for run_list in self._page_run_remotes.pop(engine_id, {}).values():
                self.nixl_wrapper.release_dlist_handle(run_list.handle)
            for agent_name in self._remote_agents.pop(engine_id, {}).values():
                self.nixl_wrapper.remove_remote_agent(agent_name)
            self.kv_caches_base_addr.pop(engine_id, None)
            self.dst_num_blocks.pop(engine_id, None)
            self.tp_mappings.pop(engine_id, None)
            if self.transfer_topo is not None:
                # upstream registers an engine once and never forgets it
                self.transfer_topo._engines.pop(engine_id, None)
        logger.warning(
            "NixlHMAConnector: a transfer from engine %s failed; its agents and "
            "descriptors are released and the next request will handshake again",
            engine_id,
        )

    @functools.cached_property
    def _scheduler_handles_multi_group_failures(self) -> bool:
        from vllm_nixl_hma.v021.scheduler import handles_multi_group_failures

        return handles_multi_group_failures(self.vllm_config.scheduler_config.scheduler_cls)

    def _report_invalid_blocks_of(self, request_id: str, meta=None) -> None:
        """Mark every local block of a failed request invalid, where the
        scheduler can take them: that is what makes vLLM 0.21.0's scheduler
        fail or recompute the request (a request reported received with no
        invalid block is decoded). Without HMA (one group: dense and
        sliding-window models on 0.21.0) upstream's scheduler takes them
        as they are; upstream marks group 0 itself at its own failure sites,
        but not at ours (the lease, unpairable lists), so they are marked
        here whatever the layout. With HMA only our schedulers can take
        several groups' blocks."""
        if self._is_hma_required and not self._scheduler_handles_multi_group_failures:
            logger.warning_once(
                "NixlHMAConnector: KV of a hybrid request did not arrive, and the configured "
                "scheduler cannot fail or recompute it; leave scheduler_cls unset to let "
                "vllm_nixl_hma select one that can"
            )
            return
        meta = meta or self._recving_metadata.get(request_id)
        if meta is None:
            return
        self._invalid_block_ids.update(
            block_id
            for group in meta.local_block_ids
            for block_id in group
            if block_id != 0  # vLLM's null block
        )
