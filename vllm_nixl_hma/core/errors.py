"""Typed errors raised by vllm_nixl_hma.

No vLLM import: the pure modules (``blocks``) raise these too. Every error
names the field that differs, the local value and the remote value, and says
what to do about it.
"""

from __future__ import annotations

__all__ = [
    "BlockAlignmentError",
    "IncompatibleRemoteError",
    "UnsupportedModelError",
    "UnsupportedVersionError",
    "UpstreamDriftError",
]


class BlockAlignmentError(ValueError):
    """Local and remote kernel-block lists of one request cannot be paired.

    Raised by the pure block arithmetic when the two sides' lists disagree in
    a way no prompt length can explain; it means the peers' metadata are
    inconsistent, so nothing must be read for that request.
    """

    def __init__(self, field: str, local: object, remote: object, reason: str):
        self.field = field
        self.local = local
        self.remote = remote
        self.reason = reason
        super().__init__(f"{field}: local={local!r}, remote={remote!r}: {reason}")


class IncompatibleRemoteError(RuntimeError):
    """A prefill peer whose configuration this decode worker must refuse.

    Raised at handshake, before the remote is used for any transfer.
    """

    def __init__(self, field: str, local: object, remote: object, remedy: str):
        self.field = field
        self.local = local
        self.remote = remote
        self.remedy = remedy
        super().__init__(f"{field} differs (local={local!r}, remote={remote!r}): {remedy}")


class UnsupportedVersionError(ImportError):
    """The installed vLLM is outside the range this release was tested with."""


class UnsupportedModelError(RuntimeError):
    """A model whose KV cache or state this connector cannot move, refused
    when the worker starts (before any handshake)."""


class UpstreamDriftError(RuntimeError):
    """A private name of vLLM's NIXL connector that a release's glue relies on is
    missing from the installed vLLM, or has other parameters (or vLLM's wire
    version differs): raised when the worker, connector or scheduler starts,
    naming what changed, instead of a fallback that would silently turn a
    check off or a ``TypeError`` on the first call."""

    def __init__(
        self,
        release: str,
        owner: str,
        missing: list[str],
        installed: str | None,
        changed: list[tuple[str, str, str]] = (),
    ):
        self.release = release
        self.owner = owner
        self.missing = missing
        self.changed = list(changed)  # (name, what the glue expects, what is installed)
        self.installed = installed
        version = installed or "(unknown version)"
        if self.changed:
            name, expected, found = self.changed[0]
            problem = (
                f"{owner}.{name}{expected}, which the installed vLLM {version} has as "
                f"{name}{found} (changed: {', '.join(c[0] for c in self.changed)})"
            )
        else:
            problem = (
                f"{owner}.{missing[0]}, which the installed vLLM {version} does not have "
                f"(missing: {', '.join(missing)})"
            )
        super().__init__(
            f"vllm_nixl_hma's glue for vLLM {release} relies on {problem}; this vLLM's "
            "NIXL connector is not the one the glue was written and tested against"
        )
