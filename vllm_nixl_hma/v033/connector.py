"""``NixlHMAConnector`` for vLLM 0.33: vLLM's ``NixlPullConnector`` with our worker.

Registered under the name ``NixlHMAConnector`` by the plugin when vLLM 0.33
is installed (``plugin.connector_module``). The scheduler side is upstream's,
plus the prefill lease in the ``kv_transfer_params`` it returns (``lease``)
and, with a key configured, their ticket: signed on prefill, judged on
decode before any handshake, agent load or read (``tickets``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_nixl_hma._compat import require_adapter

require_adapter("v033", "vllm_nixl_hma.v033.connector")

from vllm.config import VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # noqa: E402
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.logger import init_logger  # noqa: E402

from vllm_nixl_hma.core import (  # noqa: E402
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
from vllm_nixl_hma.v033.lease_checks import LEASE_EXTENSIONS_ATTR  # noqa: E402
from vllm_nixl_hma.v033.listener import NixlHMAConnectorScheduler  # noqa: E402
from vllm_nixl_hma.v033.worker import NixlHMAConnectorWorker  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

#: vLLM 0.33's key for a deadline on the sender's perf_counter clock
EXPIRY_PARAM = "remote_blocks_expiry_time"

__all__ = ["NixlHMAConnector", "NixlHMAConnectorWorker"]

logger = init_logger(f"vllm.{__name__}")


class NixlHMAConnector(NixlPullConnector):
    """Drop-in replacement for vLLM 0.33's ``NixlConnector`` (``NixlPullConnector``)."""

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
        """vLLM 0.33.0 ``NixlPullConnector.__init__``, with our worker class.

        Why: upstream hard-codes ``NixlPullConnectorWorker`` for the worker
        role, and building it only to replace it would create (and leak) a
        NIXL agent. What changes: ``NixlBaseConnector.__init__`` (upstream's
        shared checks and state), then the scheduler as upstream builds it and
        the worker as ``worker_cls``. Remove when: upstream takes the worker
        class as a parameter.
        """
        upstream_contract.installed().require_connector_class(NixlPullConnector, KVConnectorBase_V1)
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        self._external_tokens = {}
        if role == KVConnectorRole.SCHEDULER:
            # a bad mamba_prefix_caching value stops startup here, naming the key
            config_values.mamba_prefix_caching(
                vllm_config.kv_transfer_config.kv_connector_extra_config
            )
            # a bad key file or ticket_ttl_s stops startup here, naming the key
            self._tickets = tickets.TicketBook.from_extra_config(
                vllm_config.kv_transfer_config.kv_connector_extra_config
            )
            if not self._tickets.enabled:
                logger.warning(tickets.NO_KEY_WARNING)
            # upstream's, with a side-channel listener that survives bad queries
            self.connector_scheduler = NixlHMAConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
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
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM 0.33.0 ``request_finished_all_groups``, plus the lease.

        Why: prefill frees a request's blocks ``kv_lease_duration`` seconds
        after it ends unless decode's heartbeats extend that, and NIXL READ is
        one-sided: decode must know the deadline to refuse a read that could
        find the blocks reused. Upstream exports the deadline only for a
        decode engine's own blocks (turn-2 readback). What changes: when
        prefill keeps blocks for decode and upstream exported no deadline,
        ``kv_transfer_params`` gains upstream's ``remote_blocks_expiry_time``
        (this scheduler's ``perf_counter``, the clock its side channel reports
        for the handshake's offset) and ``lease.EXTENSION_PARAM``; with a key,
        then ``tickets.PARAM``, signed over all of them (decode must not read
        what a client named in its own params). Remove when: upstream's
        decode refuses reads past prefill's lease and authenticates params.
        """
        delay_free, params = super().request_finished_all_groups(request, block_ids)
        return delay_free, self._signed(self._with_lease(request, delay_free, params), delay_free)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """As ``request_finished_all_groups``, for engines without HMA."""
        delay_free, params = super().request_finished(request, block_ids)
        return delay_free, self._signed(self._with_lease(request, delay_free, params), delay_free)

    def _signed(self, params: dict[str, Any] | None, delay_free: bool) -> dict[str, Any] | None:
        if not delay_free or params is None:
            return params
        return self._tickets.signed(params)

    def on_new_request(self, request: Request) -> None:
        """vLLM 0.33.0 ``on_new_request``, then no heartbeat for a request
        whose ticket fails.

        Why: upstream starts heartbeating the remote request a new request's
        ``kv_transfer_params`` name as it arrives, which extends that
        request's lease on prefill (another client's request, for a forged
        ticket). What changes: with a key, the ticket is looked at (not
        consumed: ``build_connector_meta`` judges it) and a failing one's
        heartbeat is stopped at once. Remove when: upstream authenticates
        its params.
        """
        super().on_new_request(request)
        params = request.kv_transfer_params
        scheduler = self.connector_scheduler
        if (
            scheduler is not None
            and params
            and params.get("do_remote_prefill")
            and self._tickets.refusal(params, consume=False) is not None
        ):
            scheduler._stop_heartbeat(request.request_id)

    def _with_lease(
        self, request: Request, delay_free: bool, params: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        scheduler = self.connector_scheduler
        if not delay_free or params is None or scheduler is None:
            return params
        deadline = scheduler._reqs_need_send.get(request.request_id)
        if deadline is not None and params.get(EXPIRY_PARAM) is None:
            params[EXPIRY_PARAM] = deadline
            # what vLLM's worker extends a lease by on each heartbeat
            params[lease.EXTENSION_PARAM] = scheduler._kv_lease_duration * 2 // 3
        return params

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int):
        """vLLM 0.33.0 ``update_state_after_alloc``, noting how many tokens a
        request reads from prefill. Why: with a decode-side prefix-cache hit,
        decode's block lists start at the hit and prefill's at token 0, which
        upstream pairs from token 0 across unequal ratios. What changes:
        ``build_connector_meta`` hands the workers each request's
        ``positions.TokenSpan``. Remove when: upstream pairs by position."""
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0:
            self._external_tokens[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput):
        """vLLM 0.33.0 ``build_connector_meta``, plus the lease extensions of the
        requests to receive (``LEASE_EXTENSIONS_ATTR``, read by the worker's
        ``start_load_kv``): upstream's ``ReqMeta`` keeps vLLM's fields of
        ``kv_transfer_params`` only; and with a key, every such request's
        ticket judged first.

        Why: ``kv_transfer_params`` come in the client's request body; with
        them decode's worker dials the host they name, loads that peer's
        agent and reads the blocks they list. What changes: a request whose
        ticket is refused (``tickets.refusals``) is logged with the reason,
        its heartbeat stopped, and moved from ``reqs_to_recv`` to
        ``tickets.METADATA_ATTR``; the worker fails it without a handshake,
        agent load or read (``ticket_checks``). Remove when: upstream
        authenticates its params.
        """
        scheduler = self.connector_scheduler
        # read before upstream's build_connector_meta, which empties the dict;
        # keyed by prefill's request id, which upstream's ReqMeta carries
        entries = [] if scheduler is None else list(scheduler._reqs_need_recv.items())
        params_of_each = [entry[0].kv_transfer_params or {} for _, entry in entries]
        extensions = lease.carried_by_request(
            ((params.get("remote_request_id"), params) for params in params_of_each),
            lease.EXTENSION_PARAM,
        )
        refused = tickets.refusals(
            self._tickets,
            (
                # (request, local block ids, cached, awaiting KV): 0.33's entry
                (request_id, entry[0].kv_transfer_params, entry[3] or any(entry[1]))
                for request_id, entry in entries
            ),
        )
        for request_id, error in refused.items():
            logger.error(tickets.REFUSED, request_id, error)
            scheduler._stop_heartbeat(request_id)
        # vLLM set num_computed_tokens of a request it parks for its KV to its
        # own hit plus what it reads, before this call
        external_tokens, self._external_tokens = self._external_tokens, {}
        spans = {
            request_id: positions.span_for_prompt(
                entry[0].num_computed_tokens, external_tokens[request_id]
            )
            for request_id, entry in entries
            if request_id in external_tokens
        }
        metadata = super().build_connector_meta(scheduler_output)
        setattr(metadata, LEASE_EXTENSIONS_ATTR, extensions)
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
