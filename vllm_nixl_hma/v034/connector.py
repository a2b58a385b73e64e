"""``NixlHMAConnector`` for vLLM 0.34: the 0.33 glue's connector with the 0.34 worker.

Registered under the name ``NixlHMAConnector`` by the plugin when vLLM 0.34
is installed (``plugin.connector_module``). vLLM 0.34.0 changed nothing the
0.33 glue's connector and scheduler side override (``vllm-nixl-hma drift``:
their names, signatures and bodies are 0.33.0's), so only the worker differs.
"""

from __future__ import annotations

from vllm_nixl_hma._compat import require_adapter

require_adapter("v034", "vllm_nixl_hma.v034.connector")

from vllm_nixl_hma.v033 import connector as connector033  # noqa: E402
from vllm_nixl_hma.v034.worker import NixlHMAConnectorWorker  # noqa: E402

__all__ = ["NixlHMAConnector", "NixlHMAConnectorWorker"]


class NixlHMAConnector(connector033.NixlHMAConnector):
    """Drop-in replacement for vLLM 0.34's ``NixlConnector`` (``NixlPullConnector``)."""

    #: Worker class built for ``KVConnectorRole.WORKER``.
    worker_cls: type[NixlHMAConnectorWorker] = NixlHMAConnectorWorker
