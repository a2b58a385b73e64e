"""The glue for vLLM 0.34 (``_compat.ADAPTERS["v034"]``), written as what
differs from the 0.33 glue (``_compat.BUILDS_ON``): its classes subclass
``vllm_nixl_hma.v033``'s, which load on 0.34 too, and override only where
vLLM 0.34.0 changed what they override (the ledger in ``worker.py``;
``docs/porting.md`` records the port).
"""
