"""The ``vllm.general_plugins`` entry point.

vLLM calls ``register`` in every process it starts (API server, engine core,
each worker), possibly several times per process. Its only effects are
idempotent: the connector name is registered with vLLM's KVConnectorFactory
once (the factory raises on a duplicate name), and the configuration hook is
installed once. Nothing heavier than ``vllm.config`` is imported here; the
connector module loads only when a config selects it.
"""

from __future__ import annotations

CONNECTOR_NAME = "NixlHMAConnector"
CONNECTOR_MODULE = "vllm_nixl_hma.connector"


def register() -> None:
    """Register ``NixlHMAConnector`` by name and install the config hook."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # Make sure we only do this once: the factory raises on a duplicate name.
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)

    from vllm_nixl_hma import config_hook

    config_hook.install()

    from vllm_nixl_hma.e2e import cpu_kernel_block, cpu_kv_core

    # each acts only when its variable is set, which only ``vllm-nixl-hma e2e`` does
    cpu_kernel_block.apply_from_env()
    cpu_kv_core.apply_from_env()
