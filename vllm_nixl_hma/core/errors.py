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
    missing from the installed vLLM: raised when the worker, connector or
    scheduler starts, naming what is missing, instead of a fallback that would
    silently turn a check off."""

    def __init__(self, release: str, owner: str, missing: list[str], installed: str | None):
        self.release = release
        self.owner = owner
        self.missing = missing
        self.installed = installed
        super().__init__(
            f"vllm_nixl_hma's glue for vLLM {release} relies on {owner}."
            + f"{missing[0]}, which the installed vLLM {installed or '(unknown version)'} "
            + f"does not have (missing: {', '.join(missing)}); this vLLM's NIXL connector "
            + "is not the one the glue was written and tested against"
        )
