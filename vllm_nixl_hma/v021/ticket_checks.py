"""The 0.21.0 worker's side of signed tickets: requests our scheduler side
refused are failed without a handshake, agent load or read
(``TicketChecks``, a part of ``NixlHMAConnectorWorker``; the rules are
``core.tickets``).
"""

from __future__ import annotations

import functools

from vllm_nixl_hma._compat import require_adapter

require_adapter("v021", "vllm_nixl_hma.v021.ticket_checks")

from vllm_nixl_hma.core import tickets  # noqa: E402
from vllm_nixl_hma.core.transfer_records import Reason  # noqa: E402

__all__ = ["TicketChecks"]


class TicketChecks:
    """Ticket refusals of ``NixlHMAConnectorWorker`` (a mixin before vLLM's
    ``NixlConnectorWorker`` in its bases)."""

    @functools.cached_property
    def _refused_by_ticket(self) -> set[str]:
        """Requests failed for their ticket, until ``get_finished`` reports them."""
        return set()

    def start_load_kv(self, metadata):
        """vLLM 0.21.0 ``NixlConnectorWorker.start_load_kv``, after failing the
        requests our scheduler side refused for their ticket.

        Why: their ``kv_transfer_params`` may name any host, engine and
        blocks. What changes: each request in ``tickets.METADATA_ATTR`` (not
        in ``reqs_to_recv``, so upstream never dials for it) is recorded as a
        failed receive, its blocks reported invalid by ``get_finished``
        (``FailureReports``), which then reports it done without asking
        upstream about the engine it names. Remove when: upstream
        authenticates its params.
        """
        for request_id, meta in (getattr(metadata, tickets.METADATA_ATTR, None) or {}).items():
            self._recving_metadata[request_id] = meta
            self._refused_by_ticket.add(request_id)
            self._note_not_read(request_id, Reason.TICKET, "ticket refused (see the scheduler log)")
            self._failed_recv_reqs.add(request_id)
        super().start_load_kv(metadata)
