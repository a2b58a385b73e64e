"""``NixlHMAConnector`` for vLLM 0.33: vLLM's ``NixlPullConnector`` with our worker.

Registered under the name ``NixlHMAConnector`` by the plugin when vLLM 0.33
is installed (``plugin.connector_module``). The scheduler side is upstream's
unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_nixl_hma._compat import require_adapter

require_adapter("v033", "vllm_nixl_hma.v033.connector")

from vllm.config import VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # noqa: E402
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (  # noqa: E402
    NixlPullConnectorScheduler,
)

from vllm_nixl_hma.v033.worker import NixlHMAConnectorWorker  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

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
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = self.worker_cls(vllm_config, self.engine_id, kv_cache_config)
