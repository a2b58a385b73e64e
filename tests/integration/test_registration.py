"""Selecting the connector by name after ``pip install``, as vLLM does.

A fresh interpreter that only calls vLLM's ``load_general_plugins()`` must
resolve ``KVTransferConfig(kv_connector="NixlHMAConnector")`` to our class,
through the ``vllm.general_plugins`` entry point of the installed
distribution (the child runs in an empty directory, so the source tree is
not on its path unless the install put it there).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import json
    from importlib.metadata import entry_points

    from vllm.plugins import load_general_plugins

    load_general_plugins()
    load_general_plugins()  # vLLM may call it again: must stay harmless

    import vllm.plugins
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm_nixl_hma import plugin

    plugin.register()  # a second registration in the same process

    by_name = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="NixlHMAConnector", kv_role="kv_consumer")
    )
    by_path = KVConnectorFactory.get_connector_class(
        KVTransferConfig(
            kv_connector="NixlHMAConnector",
            kv_connector_module_path="vllm_nixl_hma",
            kv_role="kv_producer",
        )
    )
    print(json.dumps({
        "entry_points": sorted(
            ep.value for ep in entry_points(group="vllm.general_plugins")
        ),
        "by_name": f"{by_name.__module__}.{by_name.__qualname__}",
        "by_path": f"{by_path.__module__}.{by_path.__qualname__}",
        "same_class": by_name is by_path,
    }))
    """
)


@pytest.mark.slow
def test_fresh_process_resolves_connector_by_name_through_entry_point(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "vllm_nixl_hma.plugin:register" in report["entry_points"]
    assert report["by_name"] == "vllm_nixl_hma.v021.connector.NixlHMAConnector"
    assert report["by_path"] == "vllm_nixl_hma.v021.connector.NixlHMAConnector"
    assert report["same_class"] is True


@pytest.mark.slow
def test_name_is_unknown_when_vllm_skips_our_plugin(tmp_path):
    """The check above can fail: with our plugin filtered out by VLLM_PLUGINS
    (and no explicit register call), the name does not resolve."""
    child = CHILD.replace("plugin.register()  # a second registration in the same process", "")
    result = subprocess.run(
        [sys.executable, "-c", child],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            "PATH": "/usr/bin:/bin",
            "HF_HUB_OFFLINE": "1",
            "HOME": str(tmp_path),
            "VLLM_PLUGINS": "some_other_plugin",
        },
    )
    assert result.returncode != 0
    assert "Unsupported connector type: NixlHMAConnector" in result.stderr
