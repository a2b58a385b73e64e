"""The 0.33.0 worker's side of prefill's lease: prefill's deadline mapped
onto decode's clock and extended by the heartbeats decode posted, no read
started and no finished read trusted within ``lease_margin_s`` of it
(``LeaseChecks``, a part of ``NixlHMAConnectorWorker``; the rules are
``core.lease``).
"""

from __future__ import annotations

import functools
import time

from vllm_nixl_hma._compat import require_adapter

require_adapter("v033", "vllm_nixl_hma.v033.lease_checks")

from vllm.logger import init_logger  # noqa: E402

from vllm_nixl_hma.core import lease  # noqa: E402
from vllm_nixl_hma.core.transfer_records import Reason  # noqa: E402

__all__ = ["LEASE_EXTENSIONS_ATTR", "LeaseChecks"]

#: why ``lease.abandon_read`` gave a read up, as a record's reason
_ABANDONED = {"lease": Reason.LATE_READ, "timeout": Reason.TIMEOUT}

logger = init_logger(f"vllm.{__name__}")

#: attribute of NixlConnectorMetadata: {remote request id: lease extension, s} (connector.py)
LEASE_EXTENSIONS_ATTR = "vllm_nixl_hma_lease_extensions"


class LeaseChecks:
    """Lease checks of ``NixlHMAConnectorWorker`` (a mixin before vLLM's
    ``NixlPullConnectorWorker`` in its bases)."""

    #: kv_connector_extra_config "lease_margin_s" (set by the worker's __init__)
    _lease_margin_s: float = lease.DEFAULT_MARGIN_S
    #: kv_connector_extra_config "read_timeout_s" (set by the worker's __init__)
    _read_timeout_s: float | None = lease.DEFAULT_READ_TIMEOUT_S

    @functools.cached_property
    def _reads_posted_at(self) -> dict[str, float]:
        """{request id: time.perf_counter() when its first read was posted}"""
        return {}

    def _send_heartbeats(self, metadata) -> None:
        """vLLM 0.33.0 ``_send_heartbeats``, noting when each was posted.

        Why: a heartbeat extends prefill's lease, and decode's lease check
        must know by when. What changes: before upstream posts the heartbeats
        of engines it holds agents for, the time is noted per remote request.
        Remove when: upstream's decode refuses reads past the lease.
        """
        now = time.perf_counter()
        for engine_id, info in metadata.heartbeat_by_engine.items():
            if self._remote_agents.get(engine_id):
                for remote_request_id in info.req_ids:
                    self._heartbeats_posted[(engine_id, remote_request_id)] = now
        super()._send_heartbeats(metadata)

    def _lease_end(self, meta) -> float | None:
        """Prefill's lease end of a request on this worker's clock, or None."""
        remote = meta.remote
        if remote is None or remote.blocks_expiry_time is None:
            return None
        # upstream state, required at construction (upstream_contract); only a
        # worker built without its constructor (vLLM's own tests) lacks it
        offset = getattr(self, "_engine_clock_offset", {}).get(remote.engine_id)
        if offset is None:  # no handshake yet: checked again once it is done
            return None
        extension = (self._recving_extra.get(remote.request_id) or {}).get(lease.EXTENSION_PARAM)
        return lease.local_deadline(
            remote.blocks_expiry_time,
            offset,
            self._heartbeats_posted.get((remote.engine_id, remote.request_id)),
            extension,
        )

    @functools.cached_property
    def _heartbeats_posted(self) -> dict[tuple[str, str], float]:
        """(remote engine, remote request id) -> when this worker last posted a heartbeat."""
        return {}

    @functools.cached_property
    def _recving_extra(self) -> dict[str, dict]:
        """remote request id -> our kv_transfer_params fields (``start_load_kv``)."""
        return {}

    def start_load_kv(self, metadata):
        """vLLM 0.33.0 ``start_load_kv``, after noting the lease extension
        prefill's glue sent. Upstream's ``ReqMeta`` keeps vLLM's fields only;
        the extension travels as an attribute our connector sets on the
        metadata (``LEASE_EXTENSIONS_ATTR``)."""
        extensions = getattr(metadata, LEASE_EXTENSIONS_ATTR, None)
        if extensions is None and getattr(metadata, "reqs_to_recv", None):
            # Our scheduler side always attaches the attribute (empty when no
            # extension): its absence means metadata from another connector,
            # or a vLLM that no longer carries our attribute to the worker.
            logger.warning_once(
                lease.missing_attribute_warning(
                    LEASE_EXTENSIONS_ATTR, "prefill's lease is taken as not extended"
                )
            )
        for remote_request_id, extension in (extensions or {}).items():
            self._recving_extra[remote_request_id] = {lease.EXTENSION_PARAM: extension}
        super().start_load_kv(metadata)

    def _read_blocks_for_req(self, req_id: str, meta):
        """vLLM 0.33.0 ``_read_blocks_for_req``, unless prefill's lease ended.

        Why: NIXL READ is one-sided; past the lease prefill may have given
        the blocks to another request, and decode would decode on its KV.
        What changes: a request with local blocks whose lease ends within
        ``lease_margin_s`` fails (``failed_recving``; vLLM fails or
        recomputes it) and nothing is read. Remove when: upstream's decode
        refuses reads past the lease.
        """
        deadline = self._lease_end(meta)
        if deadline is not None and lease.refuse_read(
            deadline, time.perf_counter(), self._lease_margin_s, meta.local_block_ids
        ):
            logger.error(lease.READ_REFUSED, req_id)
            self._note_not_read(req_id, Reason.LEASE, "prefill's lease ends within the margin")
            self.xfer_stats.record_kv_expired_req()
            self._handle_failed_transfer(
                req_id, None, self._recv_failures, record_failed_transfer=False
            )
            self._forget_lease_of(meta)
            return
        super()._read_blocks_for_req(req_id, meta)
        # (absent in workers built without upstream's constructor: vLLM's own tests)
        if getattr(self, "_recving_transfers", {}).get(req_id):
            self._reads_posted_at.setdefault(req_id, time.perf_counter())

    def _pop_done_transfers(self, transfers):
        """vLLM 0.33.0 ``_pop_done_transfers``, after giving up reads in flight
        too long; a read that finished within ``lease_margin_s`` of the
        lease's end counts as failed (its request's metadata is still there
        at this point of ``get_transfer_results``).

        Why: upstream waits for a posted read for ever, and prefill's lease
        keeps being extended by the heartbeats decode posts while it waits,
        so a prefill host gone without a reset leaves the request in flight
        for as long as UCX keeps the connection. What changes: a read still
        in flight at the lease margin or ``read_timeout_s`` after it was
        posted (``lease.abandon_read``) fails as upstream fails a transfer
        (``_handle_failed_transfer``: the engine marked failed, each handle
        released or, where NIXL cannot release it, kept with its blocks).
        Remove when: upstream bounds a read's time.
        """
        abandoned_done, abandoned_failed = self._abandon_overdue_reads(transfers)
        done, failed = super()._pop_done_transfers(transfers)
        done |= abandoned_done
        failed |= abandoned_failed
        now = time.perf_counter()
        for request_id in done:
            meta = self._recving_metadata.get(request_id)
            deadline = self._lease_end(meta) if meta is not None else None
            if deadline is not None and lease.untrusted_read(deadline, now, self._lease_margin_s):
                logger.error(lease.READ_FINISHED_LATE, request_id)
                self._note_not_read(request_id, Reason.LATE_READ, "finished past the lease")
                failed.add(request_id)
        for request_id in done | failed:
            self._forget_lease_of(self._recving_metadata.get(request_id))
        for request_id in done:
            self._reads_posted_at.pop(request_id, None)
        return done, failed

    def _abandon_overdue_reads(self, transfers) -> tuple[set[str], set[str]]:
        now = time.perf_counter()
        done: set[str] = set()
        failed: set[str] = set()
        kept_in_flight_s: dict[str, float] = {}
        for request_id, handles in list(transfers.items()):
            meta = self._recving_metadata.get(request_id)
            posted_at = self._reads_posted_at.get(request_id)
            in_flight_s = None if posted_at is None else now - posted_at
            reason = lease.abandon_read(
                self._lease_end(meta) if meta is not None else None,
                now,
                self._lease_margin_s,
                in_flight_s,
                self._read_timeout_s,
            )
            if reason is None:
                if in_flight_s is not None:
                    kept_in_flight_s[request_id] = in_flight_s
                continue
            logger.error(lease.READ_ABANDONED, request_id, in_flight_s or 0.0, reason)
            self._note_not_read(request_id, _ABANDONED[reason], f"in flight: {reason}")
            retained = [
                handle
                for handle in handles
                if not self._handle_failed_transfer(request_id, handle, failed)
            ]
            if retained:  # upstream's rule: a handle it could not release is kept
                transfers[request_id] = retained
            else:
                del transfers[request_id]
                done.add(request_id)
        self._note_slow_reads(transfers, kept_in_flight_s)  # counted and logged once
        return done, failed

    def _forget_lease_of(self, meta) -> None:
        if meta is not None and meta.remote is not None:
            self._heartbeats_posted.pop((meta.remote.engine_id, meta.remote.request_id), None)
            self._recving_extra.pop(meta.remote.request_id, None)
