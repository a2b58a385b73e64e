"""The release-independent core: every decision both vLLM releases' glue shares.

Block pairing (``blocks``), the handshake record and its checks
(``handshake``), Mamba2 and GatedDeltaNet state geometry (``mamba_conv``,
``state_split``), the prefill lease (``lease``), page runs and NIXL's read
threads (``page_runs``, ``read_threads``), the side-channel client
(``side_channel``), KV cache group kinds (``groups``), the upstream names
each glue relies on (``upstream_contract``) and the typed errors
(``errors``). None of these imports vLLM or torch at import time
(``groups`` and ``state_split`` read vLLM objects handed to them); each is
tested once, in every release's environment where it matters.
"""
