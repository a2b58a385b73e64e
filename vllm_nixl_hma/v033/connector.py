"""``NixlHMAConnector`` for vLLM 0.33: vLLM's ``NixlPullConnector`` with our worker.

Registered under the name ``NixlHMAConnector`` by the plugin when vLLM 0.33
is installed (``plugin.connector_module``). The scheduler side is upstream's,
plus the prefill lease in the ``kv_transfer_params`` it returns (``lease``).
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
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (  # noqa: E402
    NixlPullConnectorScheduler,
)

from vllm_nixl_hma.core import lease, upstream_contract  # noqa: E402
from vllm_nixl_hma.v033.lease_checks import LEASE_EXTENSIONS_ATTR  # noqa: E402
from vllm_nixl_hma.v033.worker import NixlHMAConnectorWorker  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

#: vLLM 0.33's key for a deadline on the sender's perf_counter clock
EXPIRY_PARAM = "remote_blocks_expiry_time"

__all__ = ["NixlHMAConnector", "NixlHMAConnectorWorker"]


class NixlHMAConnector(NixlPullConnector):
    """Drop-in replacement for vLLM 0.33's ``NixlConnector`` (``NixlPullConnector``)."""

    #: Worker class built for ``KVConnectorRole.WORKER``.
    worker_cls: type[NixlHMAConnectorWorker] = NixlHMAConnectorWorker

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
        upstream_contract.V033.require_connector_class(NixlPullConnector, KVConnectorBase_V1)
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = self.worker_cls(vllm_config, self.engine_id, kv_cache_config)

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
        for the handshake's offset) and ``lease.EXTENSION_PARAM``. Remove
        when: upstream's decode refuses reads past prefill's lease.
        """
        delay_free, params = super().request_finished_all_groups(request, block_ids)
        return delay_free, self._with_lease(request, delay_free, params)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """As ``request_finished_all_groups``, for engines without HMA."""
        delay_free, params = super().request_finished(request, block_ids)
        return delay_free, self._with_lease(request, delay_free, params)

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

    def build_connector_meta(self, scheduler_output: SchedulerOutput):
        """vLLM 0.33.0 ``build_connector_meta``, plus the lease extensions of the
        requests to receive (``LEASE_EXTENSIONS_ATTR``, read by the worker's
        ``start_load_kv``): upstream's ``ReqMeta`` keeps vLLM's fields of
        ``kv_transfer_params`` only."""
        scheduler = self.connector_scheduler
        # read before upstream's build_connector_meta, which empties the dict;
        # keyed by prefill's request id, which upstream's ReqMeta carries
        entries = [] if scheduler is None else scheduler._reqs_need_recv.values()
        params_of_each = [entry[0].kv_transfer_params or {} for entry in entries]
        extensions = lease.carried_by_request(
            ((params.get("remote_request_id"), params) for params in params_of_each),
            lease.EXTENSION_PARAM,
        )
        metadata = super().build_connector_meta(scheduler_output)
        setattr(metadata, LEASE_EXTENSIONS_ATTR, extensions)
        return metadata
