"""``NixlHMAConnector``: vLLM's ``NixlConnector`` with ``NixlHMAConnectorWorker``.

Selected by ``--kv-transfer-config '{"kv_connector":"NixlHMAConnector",...}'``
once the plugin is installed (the ``vllm.general_plugins`` entry point
registers the name), or with ``"kv_connector_module_path":"vllm_nixl_hma"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_nixl_hma._compat import require_supported_vllm

require_supported_vllm()

from vllm.config import VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # noqa: E402
    NixlConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (  # noqa: E402
    NixlConnectorScheduler,
)

from vllm_nixl_hma.worker import NixlHMAConnectorWorker  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["NixlHMAConnector"]


class NixlHMAConnector(NixlConnector):
    """Drop-in replacement for ``NixlConnector`` for hybrid models under HMA.

    Everything but the worker class is upstream's: the scheduler side, the
    side-channel handshake server, the wire format.
    """

    #: Worker class built for ``KVConnectorRole.WORKER``.
    worker_cls: type[NixlHMAConnectorWorker] = NixlHMAConnectorWorker

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
        self.connector_scheduler: NixlConnectorScheduler | None = None
        self.connector_worker: NixlHMAConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = self.worker_cls(vllm_config, self.engine_id, kv_cache_config)
