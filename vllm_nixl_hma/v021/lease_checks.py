"""The 0.21.0 worker's side of prefill's lease: the deadlines our scheduler
side attaches to the connector metadata, no read started and no finished
read trusted within ``lease_margin_s`` of them (``LeaseChecks``, a part of
``NixlHMAConnectorWorker``; the rules are ``core.lease``).
"""

from __future__ import annotations

import functools
import time

from vllm_nixl_hma._compat import require_adapter

require_adapter("v021", "vllm_nixl_hma.v021.lease_checks")

from vllm.logger import init_logger  # noqa: E402

from vllm_nixl_hma.core import lease  # noqa: E402
from vllm_nixl_hma.core.transfer_records import Reason  # noqa: E402

__all__ = ["LEASE_DEADLINES_ATTR", "LeaseChecks"]

#: why ``lease.abandon_read`` gave a read up, as a record's reason
_ABANDONED = {"lease": Reason.LATE_READ, "timeout": Reason.TIMEOUT}

logger = init_logger(f"vllm.{__name__}")


#: attribute of NixlConnectorMetadata with {request id: lease end} (connector.py)
LEASE_DEADLINES_ATTR = "vllm_nixl_hma_lease_deadlines"


class LeaseChecks:
    """Lease checks of ``NixlHMAConnectorWorker`` (a mixin before vLLM's
    ``NixlConnectorWorker`` in its bases)."""

    # ----------------------------------------------------------- prefill lease

    @functools.cached_property
    def _lease_margin_s(self) -> float:
        return lease.configured_margin_s(self.kv_transfer_config.kv_connector_extra_config)

    @functools.cached_property
    def _lease_deadlines(self) -> dict[str, float]:
        return {}

    @functools.cached_property
    def _read_timeout_s(self) -> float | None:
        return lease.configured_read_timeout_s(self.kv_transfer_config.kv_connector_extra_config)

    @functools.cached_property
    def _reads_posted_at(self) -> dict[str, float]:
        """{request id: time.monotonic() when its first read was posted}"""
        return {}

    def start_load_kv(self, metadata):
        """vLLM 0.21.0 ``NixlConnectorWorker.start_load_kv``, after noting the
        lease ends the scheduler side attached (see the ledger), and after
        giving a request with no local block one empty list per KV cache
        group: vLLM hands such a request (a notify-only copy) over with no
        group at all, and upstream's handshake-failure callback then raises
        ``IndexError`` on ``local_block_ids[0]`` before it adds the request
        to the failed set, so the request's metadata stayed behind forever.
        With empty groups the callback runs to its end and ``get_finished``
        drops the request (see the ledger); ``_read_blocks`` hands upstream
        the empty list it takes for "notify prefill only"."""
        deadlines = getattr(metadata, LEASE_DEADLINES_ATTR, None)
        if deadlines is not None:
            self._lease_deadlines.update(deadlines)
        elif getattr(metadata, "reqs_to_recv", None):
            # Our scheduler side always attaches the attribute (empty without a lease)
            logger.warning_once(
                lease.missing_attribute_warning(
                    LEASE_DEADLINES_ATTR, "reads are not checked against prefill's lease"
                )
            )
        config = getattr(self, "kv_cache_config", None)  # absent in workers built bare
        num_groups = max(len(getattr(config, "kv_cache_groups", ())), 1)
        for meta in getattr(metadata, "reqs_to_recv", {}).values():
            if not meta.local_block_ids:
                meta.local_block_ids = [[] for _ in range(num_groups)]
        super().start_load_kv(metadata)

    def _read_blocks_for_req(self, req_id: str, meta):
        """vLLM 0.21.0 ``NixlConnectorWorker._read_blocks_for_req``, unless the
        lease has run out: then nothing is read and the request fails. A
        request with no local block reads nothing and only notifies prefill:
        upstream's, lease or not."""
        deadline = self._lease_deadlines.get(req_id)
        if deadline is not None and lease.refuse_read(
            deadline, time.time(), self._lease_margin_s, meta.local_block_ids
        ):
            logger.error(lease.READ_REFUSED, req_id)
            self._note_not_read(req_id, Reason.LEASE, "prefill's lease ends within the margin")
            self._failed_recv_reqs.add(req_id)
            return
        super()._read_blocks_for_req(req_id, meta)
        # (absent in workers built without upstream's constructor: vLLM's own tests)
        if getattr(self, "_recving_transfers", {}).get(req_id):
            self._reads_posted_at.setdefault(req_id, time.monotonic())

    def _pop_done_transfers(self, transfers):
        """vLLM 0.21.0 ``NixlConnectorWorker._pop_done_transfers``, after
        giving up reads still in flight too long, and with a read that
        finished past the lease reported invalid (the request's metadata is
        still there at this point of ``get_finished``).

        Why: upstream waits for a read for ever. A prefill host that vanished
        without a reset (link or host down) leaves its reads in flight for as
        long as UCX keeps the connection: the request never ends and holds
        its blocks. What changes: a read still in flight when
        ``lease.abandon_read`` says so (the lease ends within the margin, or
        ``read_timeout_s`` passed since it was posted) is failed as a failed
        transfer is (``_handle_failed_transfer``: handles released, blocks
        reported invalid, the engine's agents released once nothing else is
        in flight from it, so a late answer has no endpoint to land through).
        Remove when: upstream bounds a read's time.
        """
        abandoned = self._abandon_overdue_reads(transfers)
        done_request_ids = super()._pop_done_transfers(transfers)
        now = time.time()
        for request_id in done_request_ids:
            self._reads_posted_at.pop(request_id, None)
            deadline = self._lease_deadlines.pop(request_id, None)
            if deadline is not None and lease.untrusted_read(deadline, now, self._lease_margin_s):
                logger.error(lease.READ_FINISHED_LATE, request_id)
                self._note_not_read(request_id, Reason.LATE_READ, "finished past the lease")
                self._report_invalid_blocks_of(request_id)
        return done_request_ids | abandoned

    def _abandon_overdue_reads(self, transfers) -> set[str]:
        now_wall, now = time.time(), time.monotonic()
        abandoned = set()
        kept_in_flight_s: dict[str, float] = {}
        for request_id, handles in list(transfers.items()):
            posted_at = self._reads_posted_at.get(request_id)
            in_flight_s = None if posted_at is None else now - posted_at
            reason = lease.abandon_read(
                self._lease_deadlines.get(request_id),
                now_wall,
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
            retained = []
            for handle in handles:
                try:
                    self._handle_failed_transfer(request_id, handle)
                except Exception as e:
                    # NIXL could not release it, so it may still write into the
                    # request's blocks: the handle (and with it the request and
                    # its blocks) is kept and released again at the next step
                    logger.error(
                        "NixlHMAConnector: releasing a read of request %s failed (%s); "
                        "its blocks stay held until a release succeeds",
                        request_id,
                        e,
                    )
                    retained.append(handle)
            if retained:
                transfers[request_id] = retained
                continue
            del transfers[request_id]
            self._reads_posted_at.pop(request_id, None)
            self._lease_deadlines.pop(request_id, None)
            abandoned.add(request_id)
        self._note_slow_reads(transfers, kept_in_flight_s)  # counted and logged once
        return abandoned
