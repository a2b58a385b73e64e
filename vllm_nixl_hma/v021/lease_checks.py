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

__all__ = ["LEASE_DEADLINES_ATTR", "LeaseChecks"]

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
            self._failed_recv_reqs.add(req_id)
            return
        super()._read_blocks_for_req(req_id, meta)

    def _pop_done_transfers(self, transfers):
        """vLLM 0.21.0 ``NixlConnectorWorker._pop_done_transfers``; a read that
        finished past the lease has its blocks reported invalid (the request's
        metadata is still there at this point of ``get_finished``)."""
        done_request_ids = super()._pop_done_transfers(transfers)
        now = time.time()
        for request_id in done_request_ids:
            deadline = self._lease_deadlines.pop(request_id, None)
            if deadline is not None and lease.untrusted_read(deadline, now, self._lease_margin_s):
                logger.error(lease.READ_FINISHED_LATE, request_id)
                self._report_invalid_blocks_of(request_id)
        return done_request_ids
