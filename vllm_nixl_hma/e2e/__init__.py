"""``vllm-nixl-hma e2e``: a P/D pair of real vLLM engines on one machine, token by token
against one engine. ``models`` makes the tiny models, ``servers`` runs the engines,
``run`` sends the prompts and compares."""
