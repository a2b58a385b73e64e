"""Configuration hook: fix up a VllmConfig that selects NixlHMAConnector.

vLLM derives the Mamba cache mode (and, for hybrids, the attention block
size) in ``VllmConfig.try_verify_and_update_config``, early in
``VllmConfig.__post_init__``, and decides whether the hybrid KV cache
manager (HMA) runs later in the same ``__post_init__``. The hook runs right
before that method, so the engine core and every worker, which receive the
finished config, agree with the scheduler. It acts only when the configured
connector is ``NixlHMAConnector``; for every other config it does nothing.

What it does for a Mamba hybrid (attention + Mamba/SSM layers):

* keeps prefix caching when the operator asked for it: ``--enable-prefix-caching``
  (vLLM 0.21.0 turns it off for hybrids unless given) or ``kv_connector_extra_config``
  ``mamba_prefix_caching: true`` (which turns it on); decode then pairs kernel
  blocks by token position (``core/positions.py``, docs/design.md section 7),
  where vLLM's tail rule reads the wrong tokens after a decode-side hit at
  unequal kernel-per-logical ratios. The Mamba cache mode is then ``align``
  unless the operator gave ``--mamba-cache-mode all`` (vLLM's own default
  for models that support ``all`` is ``all``; ``align`` is what vLLM 0.33
  keeps and what the real-engine tests run). In either mode vLLM 0.21.0
  replaces a request's Mamba blocks before its running state with its null
  block once they are computed, so a request whose KV arrived holds one
  state block, the one prefill's running state is read into
  (docs/design.md section 7). ``--mamba-cache-mode all`` for a model vLLM
  cannot cache that way, or chunked prefill off in ``align`` (which needs
  it), stops startup naming the reason;
* turns prefix caching off, with one warning line, when it is on and
  ``mamba_prefix_caching`` is ``false``;
* turns HMA on when the user expressed no preference and the platform
  supports it (vLLM 0.21.0 turns HMA off whenever a KV connector is set,
  unless --no-disable-hybrid-kv-cache-manager is given);
* refuses an explicit --disable-hybrid-kv-cache-manager: the connector
  moves Mamba state only under HMA.

For every config that selects NixlHMAConnector (hybrid or not) and names no
scheduler class of its own, it selects ``vllm_nixl_hma.v021.scheduler``'s factory,
whose schedulers can fail or recompute a multi-group request whose KV did not
arrive (vLLM 0.21.0's cannot; the worker reports such requests only to them).

On vLLM 0.33 the hook changes nothing: 0.33 keeps HMA on for connectors that
support it, fails or recomputes a multi-group request through
``failed_recving`` itself, and prefix caching of a Mamba hybrid works in P/D
at equal TP, so it stays the user's choice; unequal kernel-per-logical ratios
with prefix caching are refused at the handshake instead (``v033/``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_nixl_hma.core.config_values import mamba_prefix_caching

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["ConfigHookError", "apply", "install", "selects_this_connector"]

_HOOK_MARK = "_vllm_nixl_hma_config_hook"

# Imported from the plugin entry point only, in processes that run vLLM.
logger = init_logger(f"vllm.{__name__}")


class ConfigHookError(ValueError):
    """A configuration the connector cannot serve; raised at startup."""


def selects_this_connector(vllm_config: VllmConfig) -> bool:
    """True when the KV transfer config names our connector class."""
    from vllm_nixl_hma.plugin import CONNECTOR_NAME

    kv_transfer_config = vllm_config.kv_transfer_config
    return (
        kv_transfer_config is not None
        and kv_transfer_config.kv_connector == CONNECTOR_NAME
        and kv_transfer_config.kv_connector_module_path in (None, "vllm_nixl_hma")
    )


def _is_mamba_hybrid(vllm_config: VllmConfig) -> bool:
    model_config = vllm_config.model_config
    return model_config is not None and bool(model_config.is_hybrid)


def apply(vllm_config: VllmConfig) -> None:
    """Edit ``vllm_config`` in place as the module docstring says."""
    if not selects_this_connector(vllm_config):
        return
    from vllm_nixl_hma import _compat

    if _compat.builds_on("v033"):
        return
    if vllm_config.scheduler_config.scheduler_cls is None:
        from vllm_nixl_hma.v021.scheduler import FACTORY_PATH

        vllm_config.scheduler_config.scheduler_cls = FACTORY_PATH
    if not _is_mamba_hybrid(vllm_config):
        return
    from vllm.platforms import current_platform

    architecture = vllm_config.model_config.architecture
    cache_config = vllm_config.cache_config
    choice = mamba_prefix_caching(vllm_config.kv_transfer_config.kv_connector_extra_config)
    if choice or (choice is None and cache_config.enable_prefix_caching):
        _keep_prefix_caching(vllm_config, architecture)
    elif cache_config.enable_prefix_caching:
        cache_config.enable_prefix_caching = False
        logger.warning(
            "NixlHMAConnector: prefix caching turned OFF for Mamba hybrid %s "
            "(kv_connector_extra_config mamba_prefix_caching is false). Pass "
            "--no-enable-prefix-caching to both engines to silence this.",
            architecture,
        )

    scheduler_config = vllm_config.scheduler_config
    if scheduler_config.disable_hybrid_kv_cache_manager is True:
        raise ConfigHookError(
            "NixlHMAConnector needs the hybrid KV cache manager for Mamba hybrid "
            f"{architecture}, but --disable-hybrid-kv-cache-manager was given: "
            "remove that flag."
        )
    if (
        scheduler_config.disable_hybrid_kv_cache_manager is None
        and current_platform.support_hybrid_kv_cache()
    ):
        scheduler_config.disable_hybrid_kv_cache_manager = False
        logger.info(
            "NixlHMAConnector: hybrid KV cache manager enabled for %s "
            "(same as --no-disable-hybrid-kv-cache-manager).",
            architecture,
        )


def _keep_prefix_caching(vllm_config: VllmConfig, architecture: str) -> None:
    """The ``mamba_prefix_caching`` opt-in: Mamba cache mode ``align``, or
    ``all`` when the operator gave it and vLLM caches this model's state that
    way."""
    cache_config = vllm_config.cache_config
    if cache_config.mamba_cache_mode == "all":
        if not vllm_config.model_config.supports_mamba_prefix_caching:
            raise ConfigHookError(
                f"NixlHMAConnector keeps prefix caching for Mamba hybrid {architecture}, "
                "but --mamba-cache-mode all was given and vLLM 0.21.0 cannot cache this "
                "model's Mamba state at every block boundary (it would fall back to "
                "'align' on its own). Remove --mamba-cache-mode or pass align."
            )
        cache_config.enable_prefix_caching = True
        logger.info(
            "NixlHMAConnector: prefix caching kept for Mamba hybrid %s, Mamba cache "
            "mode 'all' (as given); block lists are paired by token position.",
            architecture,
        )
        return
    if not vllm_config.scheduler_config.enable_chunked_prefill:
        raise ConfigHookError(
            f"NixlHMAConnector keeps prefix caching for Mamba hybrid {architecture} in "
            "Mamba cache mode 'align', which needs chunked prefill, but it is off: "
            "remove --no-enable-chunked-prefill, pass --mamba-cache-mode all (where "
            "vLLM supports it for this model), or drop mamba_prefix_caching."
        )
    cache_config.enable_prefix_caching = True
    cache_config.mamba_cache_mode = "align"
    logger.info(
        "NixlHMAConnector: prefix caching kept for Mamba hybrid %s (mamba_prefix_caching), "
        "Mamba cache mode 'align'; block lists are paired by token position.",
        architecture,
    )


def install() -> None:
    """Run ``apply`` before every ``VllmConfig.try_verify_and_update_config``.

    Idempotent: a second call finds the hook in place and returns. The
    wrapper changes nothing for configs that do not select this connector.
    """
    from vllm.config import VllmConfig

    original = VllmConfig.try_verify_and_update_config
    if getattr(original, _HOOK_MARK, False):
        return

    @functools.wraps(original)
    def try_verify_and_update_config(self: VllmConfig, *args: Any, **kwargs: Any) -> Any:
        apply(self)
        return original(self, *args, **kwargs)

    setattr(try_verify_and_update_config, _HOOK_MARK, True)
    VllmConfig.try_verify_and_update_config = try_verify_and_update_config
