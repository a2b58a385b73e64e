"""pytest plugin (``-p nixl_hma_upstream_swap``): vLLM's NIXL connector test
suite, run against this plugin's classes.

Before vLLM's test modules import them, the names they import are ours. On
vLLM 0.21.0: ``NixlConnector`` (also what ``KVConnectorFactory`` builds for
the name "NixlConnector"), ``NixlConnectorWorker``, ``Scheduler`` and
``AsyncScheduler``. On vLLM 0.33, where ``NixlConnector`` and
``NixlConnectorWorker`` are aliases of the pull connector and its worker and
the plugin has no scheduler: both names of each, wherever the suite imports
them from (the factory builds "NixlConnector" and "NixlPullConnector" from
the package). Test-local subclasses (the suite's fake workers) then subclass
ours, as a user's would. vLLM 0.34 as 0.33, with the 0.34 glue's classes.
"""

from __future__ import annotations

import vllm.distributed.kv_transfer.kv_connector.v1.nixl as nixl_package
import vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector as nixl_connector
import vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker as nixl_worker

from vllm_nixl_hma import _compat


def _swaps() -> tuple:
    if _compat.builds_on("v033"):
        import importlib

        import vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker as pull_worker

        # the installed release's glue: v033, or v034 (built on it)
        glue = importlib.import_module(_compat.glue_module(_compat.adapter(), "connector"))
        NixlHMAConnector = glue.NixlHMAConnector
        NixlHMAConnectorWorker = glue.NixlHMAConnectorWorker

        return (
            *(
                (module, name, NixlHMAConnector)
                for module in (nixl_package, nixl_connector)
                for name in ("NixlConnector", "NixlPullConnector")
            ),
            *(
                (module, name, NixlHMAConnectorWorker)
                for module in (nixl_package, nixl_worker)
                for name in ("NixlConnectorWorker", "NixlPullConnectorWorker")
            ),
            (pull_worker, "NixlPullConnectorWorker", NixlHMAConnectorWorker),
        )
    import vllm.v1.core.sched.async_scheduler as async_scheduler
    import vllm.v1.core.sched.scheduler as scheduler

    from vllm_nixl_hma.v021.connector import NixlHMAConnector
    from vllm_nixl_hma.v021.scheduler import NixlHMAAsyncScheduler, NixlHMAScheduler
    from vllm_nixl_hma.v021.worker import NixlHMAConnectorWorker

    return (
        (nixl_package, "NixlConnector", NixlHMAConnector),
        (nixl_connector, "NixlConnector", NixlHMAConnector),
        (nixl_package, "NixlConnectorWorker", NixlHMAConnectorWorker),
        (nixl_connector, "NixlConnectorWorker", NixlHMAConnectorWorker),
        (nixl_worker, "NixlConnectorWorker", NixlHMAConnectorWorker),
        (scheduler, "Scheduler", NixlHMAScheduler),
        (async_scheduler, "AsyncScheduler", NixlHMAAsyncScheduler),
    )


SWAPS = _swaps()

#: our class names -> the names of the classes they replace: test ids that a
#: parametrization builds from a class's name are reported under upstream's
#: (nixl_hma_upstream_env), so that stock's and ours' outcomes line up
NODE_ID_NAMES = {ours.__name__: getattr(module, name).__name__ for module, name, ours in SWAPS}

for module, name, ours in SWAPS:
    setattr(module, name, ours)


def pytest_report_header(config):
    return "nixl_hma_upstream_swap: " + ", ".join(
        f"{module.__name__}.{name} -> {ours.__name__}" for module, name, ours in SWAPS
    )
