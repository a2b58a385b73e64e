"""``python -m vllm_nixl_hma``: same as the ``vllm-nixl-hma`` console script."""

from vllm_nixl_hma.cli import main

raise SystemExit(main())
