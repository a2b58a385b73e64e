"""The glue for vLLM 0.33 (``_compat.ADAPTERS["v033"]``).

vLLM 0.33 rewrote its NIXL connector (``nixl/base_worker.py``,
``nixl/pull_worker.py``) and fixed several things the 0.21.0 glue works
around: the remote kernel-block expansion, per-request failure reporting
(``failed_recving``), forgetting dead or replaced engines, HMA on for
connectors that support it, GatedDeltaNet state under heterogeneous TP. None
of those is redone here. What is left is the ledger in ``worker.py``.
"""
