"""The 0.33.0 worker's side of signed tickets: requests our scheduler side
refused are failed without a handshake, agent load or read
(``TicketChecks``, a part of ``NixlHMAConnectorWorker``; the rules are
``core.tickets``).
"""

from __future__ import annotations

from vllm_nixl_hma._compat import require_adapter

require_adapter("v033", "vllm_nixl_hma.v033.ticket_checks")

from vllm_nixl_hma.core import tickets  # noqa: E402
from vllm_nixl_hma.core.transfer_records import Reason  # noqa: E402

__all__ = ["TicketChecks"]


class TicketChecks:
    """Ticket refusals of ``NixlHMAConnectorWorker`` (a mixin before vLLM's
    ``NixlPullConnectorWorker`` in its bases)."""

    def start_load_kv(self, metadata):
        """vLLM 0.33.0 ``start_load_kv``, after failing the requests our
        scheduler side refused for their ticket.

        Why: their ``kv_transfer_params`` may name any host, engine and
        blocks, and upstream dials, loads and reads what they name. What
        changes: each request in ``tickets.METADATA_ATTR`` (not in
        ``reqs_to_recv``, so upstream never dials for it) that the scheduler
        awaits is failed as upstream fails a transfer it declines
        (``_handle_failed_transfer`` without a handle or a transport-failure
        count: reported in ``failed_recving``, vLLM fails or recomputes it);
        one only meant to notify prefill is dropped, notifying no one.
        Remove when: upstream authenticates its params.
        """
        for request_id, meta in (getattr(metadata, tickets.METADATA_ATTR, None) or {}).items():
            if meta.awaiting_kvs or any(meta.local_block_ids):
                self._recving_metadata[request_id] = meta
                self._note_not_read(
                    request_id, Reason.TICKET, "ticket refused (see the scheduler log)"
                )
                self._handle_failed_transfer(
                    request_id, None, self._recv_failures, record_failed_transfer=False
                )
        super().start_load_kv(metadata)
