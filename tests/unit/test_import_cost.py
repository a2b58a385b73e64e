"""Importing the package, its plugin module and its pure modules loads no vLLM or torch.

The plugin entry point imports the package in every vLLM process; the pure
modules must stay testable without vLLM (style.md, "Module boundaries").
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_package_plugin_and_pure_modules_import_neither_vllm_nor_torch():
    script = textwrap.dedent(
        """
        import sys
        import vllm_nixl_hma, vllm_nixl_hma.plugin
        import vllm_nixl_hma.core.blocks, vllm_nixl_hma.core.errors, vllm_nixl_hma._compat
        import vllm_nixl_hma.core.positions, vllm_nixl_hma.core.transfer_records
        from vllm_nixl_hma.core.blocks import logical_to_kernel_ids
        assert logical_to_kernel_ids([1], 2).tolist() == [2, 3]
        heavy = sorted(m for m in ("vllm", "torch", "nixl", "nixl_cu12") if m in sys.modules)
        print("heavy:", heavy)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "heavy: []" in out


def test_lazy_exports_resolve_to_the_connector_classes():
    """Of the installed vLLM's glue (run on vLLM 0.21 and 0.33)."""
    import vllm_nixl_hma
    from vllm_nixl_hma import _compat, plugin

    assert vllm_nixl_hma.NixlHMAConnector.__name__ == "NixlHMAConnector"
    assert vllm_nixl_hma.NixlHMAConnector.__module__ == plugin.connector_module()
    glue = _compat.glue_module(_compat.adapter(), "connector")
    assert vllm_nixl_hma.NixlHMAConnector.__module__ == glue
    assert vllm_nixl_hma.NixlHMAConnectorWorker.__name__ == "NixlHMAConnectorWorker"
    assert set(vllm_nixl_hma.__all__) <= set(dir(vllm_nixl_hma))
