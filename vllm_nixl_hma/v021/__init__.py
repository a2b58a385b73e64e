"""The glue for vLLM 0.21.0 (``_compat.ADAPTERS["v021"]``).

``connector`` (``NixlHMAConnector`` on vLLM's ``NixlConnector``), ``worker``
(``NixlHMAConnectorWorker``; its module docstring is the ledger of departures
from upstream), ``scheduler`` (vLLM's schedulers, able to fail or recompute a
request of several KV cache groups) and ``config_hook`` (prefix caching off and
HMA on for Mamba hybrids, our scheduler). Decisions shared with the 0.33 glue
live in ``vllm_nixl_hma.core``.
"""
