"""pytest plugin (``-p nixl_hma_upstream_swap``): vLLM's NIXL connector test
suite, run against this plugin's classes.

Before vLLM's test modules import them, the names they import are ours:
``NixlConnector`` (also what ``KVConnectorFactory`` builds for the name
"NixlConnector"), ``NixlConnectorWorker``, ``Scheduler`` and
``AsyncScheduler``. Test-local subclasses (the suite's fake workers) then
subclass ours, as a user's would.
"""

from __future__ import annotations

import vllm.distributed.kv_transfer.kv_connector.v1.nixl as nixl_package
import vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector as nixl_connector
import vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker as nixl_worker
import vllm.v1.core.sched.async_scheduler as async_scheduler
import vllm.v1.core.sched.scheduler as scheduler

from vllm_nixl_hma.connector import NixlHMAConnector
from vllm_nixl_hma.scheduler import NixlHMAAsyncScheduler, NixlHMAScheduler
from vllm_nixl_hma.worker import NixlHMAConnectorWorker

SWAPS = (
    (nixl_package, "NixlConnector", NixlHMAConnector),
    (nixl_connector, "NixlConnector", NixlHMAConnector),
    (nixl_package, "NixlConnectorWorker", NixlHMAConnectorWorker),
    (nixl_connector, "NixlConnectorWorker", NixlHMAConnectorWorker),
    (nixl_worker, "NixlConnectorWorker", NixlHMAConnectorWorker),
    (scheduler, "Scheduler", NixlHMAScheduler),
    (async_scheduler, "AsyncScheduler", NixlHMAAsyncScheduler),
)

for module, name, ours in SWAPS:
    setattr(module, name, ours)


def pytest_report_header(config):
    return "nixl_hma_upstream_swap: " + ", ".join(
        f"{module.__name__}.{name} -> {ours.__name__}" for module, name, ours in SWAPS
    )
