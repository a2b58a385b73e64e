"""vllm_nixl_hma: NIXL P/D KV connector for hybrid models under vLLM's HMA.

Importing the package is cheap: the connector classes (and with them vLLM,
torch and NIXL) load on first attribute access, because the plugin entry
point imports this package in every vLLM process, used or not. They come
from the glue of the installed vLLM (``_compat.adapter``), so
``"kv_connector_module_path": "vllm_nixl_hma"`` works on either release.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["NixlHMAConnector", "NixlHMAConnectorWorker", "__version__"]

if TYPE_CHECKING:
    from vllm_nixl_hma.v021.connector import NixlHMAConnector
    from vllm_nixl_hma.v021.worker import NixlHMAConnectorWorker

#: exported name -> its module in the installed release's glue (``_compat.glue_module``)
_LAZY_EXPORTS = {"NixlHMAConnector": "connector", "NixlHMAConnectorWorker": "worker"}


def __getattr__(name: str) -> Any:
    if name not in __all__ or name == "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    from vllm_nixl_hma import _compat

    module_name = _compat.glue_module(_compat.adapter(), _LAZY_EXPORTS[name])
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
