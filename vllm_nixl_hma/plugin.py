"""The ``vllm.general_plugins`` entry point.

vLLM calls ``register`` in every process it starts (API server, engine core,
each worker), possibly several times per process. Its only effects are
idempotent: the connector name is registered with vLLM's KVConnectorFactory
once (the factory raises on a duplicate name), and the configuration hook is
installed once. Nothing heavier than ``vllm.config`` is imported here; the
connector module loads only when a config selects it.
"""

from __future__ import annotations

from vllm_nixl_hma import _compat

CONNECTOR_NAME = "NixlHMAConnector"


def connector_module() -> str:
    """The module of ``NixlHMAConnector`` for the installed vLLM. On a release
    the plugin does not support: the 0.21.0 module, whose import refuses with
    one sentence naming both versions (only if a config selects the connector)."""
    try:
        return _compat.glue_module(_compat.adapter(), "connector")
    except ImportError:  # UnsupportedVersionError
        return _compat.glue_module("v021", "connector")


def register() -> None:
    """Register ``NixlHMAConnector`` by name and install the config hook."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    module = connector_module()
    # Make sure we only do this once: the factory raises on a duplicate name.
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, module, CONNECTOR_NAME)

    from vllm_nixl_hma.v021 import config_hook

    config_hook.install()

    from vllm_nixl_hma.e2e import cpu_kernel_block, cpu_kv_core, cpu_mamba_copy, cpu_moe

    # each acts only when its variable is set, which only ``vllm-nixl-hma e2e`` does
    cpu_kernel_block.apply_from_env()
    cpu_kv_core.apply_from_env()
    cpu_moe.apply_from_env()
    cpu_mamba_copy.apply_from_env()
