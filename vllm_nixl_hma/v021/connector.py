"""``NixlHMAConnector``: vLLM's ``NixlConnector`` with ``NixlHMAConnectorWorker``.

Selected by ``--kv-transfer-config '{"kv_connector":"NixlHMAConnector",...}'``
once the plugin is installed (the ``vllm.general_plugins`` entry point
registers the name), or with ``"kv_connector_module_path":"vllm_nixl_hma"``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm_nixl_hma._compat import require_adapter

require_adapter("v021", "vllm_nixl_hma.v021.connector")

from vllm import envs  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # noqa: E402
    NixlConnector,
)
from vllm.logger import init_logger  # noqa: E402

from vllm_nixl_hma.core import (  # noqa: E402
    blocks,
    config_values,
    lease,
    positions,
    tickets,
    upstream_contract,
)
from vllm_nixl_hma.transfer_stats import (  # noqa: E402
    NixlHMAKVConnectorStats,
    NixlHMAPromMetrics,
)
from vllm_nixl_hma.v021.lease_checks import LEASE_DEADLINES_ATTR  # noqa: E402
from vllm_nixl_hma.v021.listener import NixlHMAConnectorScheduler  # noqa: E402
from vllm_nixl_hma.v021.worker import NixlHMAConnectorWorker  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["NixlHMAConnector"]

logger = init_logger(f"vllm.{__name__}")


class NixlHMAConnector(NixlConnector):
    """Drop-in replacement for ``NixlConnector`` for hybrid models under HMA.

    Besides the worker class, it departs from upstream on the scheduler side
    to carry the prefill lease (``lease.py``): prefill adds its end to the
    ``kv_transfer_params`` it returns, decode hands it to its workers with
    the connector metadata; and, with a key configured, to sign those params
    on prefill and refuse on decode those whose ticket fails (``tickets``).
    """

    #: Worker class built for ``KVConnectorRole.WORKER``.
    worker_cls: type[NixlHMAConnectorWorker] = NixlHMAConnectorWorker
    #: the scheduler side's keys and honoured tickets (``__init__``); this
    #: default, without a key, for a connector built without our constructor
    _tickets: tickets.TicketBook = tickets.TicketBook(None)
    #: {request id: tokens it reads from prefill}, from ``update_state_after_alloc``
    #: to the ``build_connector_meta`` of the same step (``positions``)
    _external_tokens: dict[str, int]

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        """vLLM 0.21.0 ``NixlConnector.__init__``.

        Why: upstream hard-codes ``NixlConnectorWorker`` for the worker role,
        and building it only to replace it would create (and leak) a second
        NIXL agent. What changes: this calls ``KVConnectorBase_V1.__init__``
        and then sets the upstream state itself: ``kv_cache_config``,
        ``engine_id``, ``kv_transfer_config``, ``connector_scheduler`` and
        ``connector_worker`` (the worker being ``worker_cls``). A test checks
        that this is the same attribute set upstream's constructor leaves.
        Remove when: upstream takes the worker class as a parameter.
        """
        upstream_contract.V021.require_connector_class(NixlConnector, KVConnectorBase_V1)
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        kv_transfer_config = vllm_config.kv_transfer_config
        if kv_transfer_config is None or kv_transfer_config.engine_id is None:
            raise ValueError(
                "NixlHMAConnector needs --kv-transfer-config with an engine_id "
                "(vLLM sets one when kv_transfer_config is given)"
            )
        self.kv_cache_config = kv_cache_config
        self.engine_id = kv_transfer_config.engine_id
        self.kv_transfer_config = kv_transfer_config
        self.connector_scheduler: NixlHMAConnectorScheduler | None = None
        self.connector_worker: NixlHMAConnectorWorker | None = None
        self._external_tokens = {}
        if role == KVConnectorRole.SCHEDULER:
            # a bad mamba_prefix_caching value stops startup here, naming the key
            config_values.mamba_prefix_caching(kv_transfer_config.kv_connector_extra_config)
            # a bad key file or ticket_ttl_s stops startup here, naming the key
            self._tickets = tickets.TicketBook.from_extra_config(
                kv_transfer_config.kv_connector_extra_config
            )
            if not self._tickets.enabled:
                logger.warning(tickets.NO_KEY_WARNING)
            # upstream's, with a side-channel listener that survives bad queries
            self.connector_scheduler = NixlHMAConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = self.worker_cls(vllm_config, self.engine_id, kv_cache_config)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        """vLLM's ``build_kv_connector_stats``, building our stats class: it
        carries the plugin's per-request counts beside vLLM's own
        (``transfer_stats``). Remove when: never (ours)."""
        return NixlHMAKVConnectorStats(data=data) if data is not None else NixlHMAKVConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        """vLLM's ``build_prom_metrics``: vLLM's NIXL metrics plus ours
        (``transfer_stats``; README, "Metrics"). Remove when: never (ours)."""
        return NixlHMAPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def request_finished_all_groups(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM 0.21.0 ``NixlConnector.request_finished_all_groups``, plus the
        lease end and the ticket. Why: decode must not read blocks prefill
        may have reused after ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, nor blocks
        a client named in its own ``kv_transfer_params``. What changes: when
        prefill keeps blocks for decode, ``kv_transfer_params`` gain
        ``lease.PARAM`` and, with a key, ``tickets.PARAM`` (signed last, over
        the lease too). Remove when: upstream carries a lease and
        authenticates its params.
        """
        delay_free, params = super().request_finished_all_groups(request, block_ids)
        return delay_free, self._with_lease_and_ticket(delay_free, params)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """As ``request_finished_all_groups``, for engines without HMA."""
        delay_free, params = super().request_finished(request, block_ids)
        return delay_free, self._with_lease_and_ticket(delay_free, params)

    def _with_lease_and_ticket(
        self, delay_free: bool, params: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        if not delay_free or params is None:
            return params
        params[lease.PARAM] = lease.lease_deadline(
            time.time(), envs.VLLM_NIXL_ABORT_REQUEST_TIMEOUT
        )
        return self._tickets.signed(params)

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int):
        """vLLM 0.21.0 ``NixlConnector.update_state_after_alloc``, noting how
        many tokens a request reads from prefill. Why: with a decode-side
        prefix-cache hit, decode's block lists start at the hit and prefill's
        at token 0, which list lengths cannot tell at unequal ratios. What
        changes: ``build_connector_meta`` hands the workers each request's
        ``positions.TokenSpan``. Remove when: upstream pairs by position."""
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0:
            self._external_tokens[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput):
        """vLLM 0.21.0 ``NixlConnector.build_connector_meta``, plus the lease
        ends of the requests to receive (an attribute of the metadata object,
        read by ``NixlHMAConnectorWorker.start_load_kv``), and with a key,
        every such request's ticket judged first.

        Why: ``kv_transfer_params`` come in the client's request body; with
        them decode's worker dials the host they name, loads that peer's
        agent and reads the blocks they list. What changes: a request whose
        ticket is refused (``tickets.refusals``: missing, malformed, unknown
        key, forged or edited, expired, replayed) is logged with the reason
        and moved from ``reqs_to_recv`` to ``tickets.METADATA_ATTR``; the
        worker fails it without a handshake, agent load or read, and vLLM
        fails or recomputes it (``kv_load_failure_policy``). Remove when:
        upstream authenticates its params.
        """
        scheduler = self.connector_scheduler
        # read before upstream's build_connector_meta, which empties the dict
        entries = [] if scheduler is None else list(scheduler._reqs_need_recv.items())
        deadlines = lease.carried_by_request(
            ((request_id, request.kv_transfer_params) for request_id, (request, _) in entries),
            lease.PARAM,
        )
        refused = tickets.refusals(
            self._tickets,
            (
                (request_id, request.kv_transfer_params, blocks.has_local_blocks(local_ids))
                for request_id, (request, local_ids) in entries
            ),
        )
        for request_id, error in refused.items():
            logger.error(tickets.REFUSED, request_id, error)
        # vLLM set num_computed_tokens of a request it parks for its KV to its
        # own hit plus what it reads, before this call
        external_tokens, self._external_tokens = self._external_tokens, {}
        spans = {
            request_id: positions.span_for_prompt(
                request.num_computed_tokens, external_tokens[request_id]
            )
            for request_id, (request, _) in entries
            if request_id in external_tokens
        }
        metadata = super().build_connector_meta(scheduler_output)
        setattr(metadata, LEASE_DEADLINES_ATTR, deadlines)
        setattr(metadata, positions.METADATA_ATTR, spans)
        setattr(
            metadata,
            tickets.METADATA_ATTR,
            {
                request_id: metadata.reqs_to_recv.pop(request_id)
                for request_id in refused
                if request_id in metadata.reqs_to_recv
            },
        )
        return metadata
