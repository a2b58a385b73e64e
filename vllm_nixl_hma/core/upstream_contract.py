"""Which private names of vLLM's NIXL connector each release's glue relies on,
and the check that they are there.

The glue subclasses vLLM's connector, worker and scheduler and calls or
replaces their private methods and reads their private state. A release that
renames one of them would not fail: an override of a method upstream no longer
calls is dead code, and a ``getattr(obj, name, default)`` turns a check off.
So every such name is listed here, per release and per upstream owner, and
``require`` is called when the worker, connector or scheduler starts; a missing
name stops startup with ``UpstreamDriftError`` naming it.

Pure: no vLLM import; the glue passes the upstream objects in. The lists are
the contract; ``tests/unit/test_upstream_contract.py`` checks on each installed
release that every override the glue defines is listed (a new override must be
added here) and that removing a listed name stops startup.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from vllm_nixl_hma.core.errors import UpstreamDriftError

__all__ = ["V021", "V033", "Contract", "names_swapped", "require"]


@dataclass(frozen=True)
class Contract:
    """One release's names, grouped by the upstream object that must have them."""

    release: str
    worker_overrides: tuple[str, ...]  # worker methods our worker overrides
    worker_calls: tuple[str, ...]  # worker methods our worker calls
    worker_module: tuple[str, ...]  # names of upstream's worker module we swap or use
    worker_state: tuple[str, ...]  # worker state upstream's constructor sets, we read
    worker_registered_state: tuple[str, ...]  # set by upstream's register_kv_caches
    connector_overrides: tuple[str, ...]
    scheduler_overrides: tuple[str, ...]
    scheduler_state: tuple[str, ...]
    #: what our scheduler reads of each of its KV cache manager's per-group
    #: managers (``kv_cache_manager.coordinator.single_type_managers``)
    group_manager_state: tuple[str, ...] = ()

    def require_worker_class(self, upstream_worker: type) -> None:
        """Before upstream's constructor: the methods we override or call."""
        require(
            upstream_worker,
            self.worker_overrides + self.worker_calls,
            owner_name=upstream_worker.__name__,
            release=self.release,
        )

    def require_state(
        self, instance: object, names: tuple[str, ...], upstream: type, after: str
    ) -> None:
        """After an upstream step (``after``): the state it must have set."""
        require(
            instance, names, owner_name=f"{upstream.__name__} (after {after})", release=self.release
        )

    def require_connector_class(self, upstream_connector: type, interface: type) -> None:
        """The connector methods we override, implemented by upstream's
        connector and not only declared by the abstract ``interface``."""
        require(
            upstream_connector,
            self.connector_overrides,
            owner_name=upstream_connector.__name__,
            release=self.release,
            below=interface,
        )


V021 = Contract(
    release="0.21.0",
    # methods of NixlConnectorWorker that our worker overrides
    worker_overrides=(
        "_build_mamba_remote",
        "_get_new_notifs",
        "_handle_failed_transfer",
        "_logical_to_remote_kernel_block_ids",
        "_nixl_handshake",
        "_pop_done_transfers",
        "_read_blocks",
        "_read_blocks_for_req",
        "_validate_remote_agent_handshake",
        "add_remote_agent",
        "get_finished",
        "register_kv_caches",
        "shutdown",
        "start_load_kv",
    ),
    # methods of NixlConnectorWorker our worker calls
    worker_calls=("_build_mamba_local", "_log_failure", "get_backend_aware_kv_block_len"),
    # names of vLLM's nixl/worker.py module the worker swaps or uses
    worker_module=("NixlWrapper", "current_platform", "derive_mamba_conv_split", "zmq_ctx"),
    # NixlConnectorWorker state that its constructor sets and our worker reads
    worker_state=(
        "_conv_decomp",
        "_failed_recv_reqs",
        "_handshake_lock",
        "_has_mamba",
        "_invalid_block_ids",
        "xfer_stats",  # replaced by ours (transfer_stats)
        "_is_hma_required",
        "_layer_specs",
        "_physical_blocks_per_logical_kv_block",
        "_recving_metadata",
        "_recving_transfers",
        "_remote_agents",
        "block_size",
        "compat_hash",
        "device_id",
        "dst_num_blocks",
        "dst_xfer_side_handles",
        "enforce_compat_hash",
        "engine_id",
        "host_buffer_kv_cache_layout",
        "host_xfer_buffers",
        "kv_cache_config",
        "kv_cache_layout",
        "kv_caches_base_addr",
        "kv_transfer_config",
        "nixl_memory_type",
        "nixl_wrapper",
        "num_blocks",
        "tp_mappings",
        "tp_rank",
        "transfer_topo",
        "use_host_buffer",
        "vllm_config",
        "world_size",
        "xfer_stats",
    ),
    # state that upstream's register_kv_caches sets
    worker_registered_state=(
        "_logical_num_blocks",
        "block_len_per_layer",
        "xfer_handshake_metadata",
    ),
    # methods of NixlConnector our connector overrides
    connector_overrides=(
        "build_connector_meta",
        "build_kv_connector_stats",
        "build_prom_metrics",
        "request_finished",
        "request_finished_all_groups",
        "update_state_after_alloc",
    ),
    # methods of vLLM's Scheduler our schedulers override, and state they read
    # (and _mamba_block_aligned_split: the call need_mamba_block_aligned_split guards)
    scheduler_overrides=(
        "_update_requests_with_invalid_blocks",
        "schedule",
        "_mamba_block_aligned_split",
    ),
    scheduler_state=("kv_cache_manager", "connector"),
    # a failed request's resume point (core.resume): its window's first token
    group_manager_state=("block_size", "get_num_skipped_tokens"),
)

V033 = Contract(
    release="0.33.0",
    # methods of NixlPullConnectorWorker (and its base) that our worker overrides
    worker_overrides=(
        "_apply_prefix_caching",
        "_build_mamba_remote",
        "_get_new_notifs",
        "_nixl_handshake",
        "_pop_done_transfers",
        "_read_blocks",
        "_read_blocks_for_req",
        "_send_heartbeats",
        "_validate_remote_agent_handshake",
        "add_remote_agent",
        "get_transfer_results",
        "start_load_kv",
    ),
    worker_calls=("_handle_failed_transfer", "_log_failure", "_pack_strided_descs"),
    worker_module=(),
    worker_state=(
        "_conv_decomp",
        "_engine_clock_offset",  # the lease: prefill's clock mapped to decode's
        "_has_mamba",
        "_is_hma_required",
        "_layer_specs",
        "_mamba_ssm_size",
        "_physical_blocks_per_logical_kv_block",
        "_ple_region_index",
        "_recv_failures",
        "_recving_metadata",
        "_recving_transfers",  # the reads in flight (given up after read_timeout_s)
        "_remote_agents",
        "_ssm_region_indices",
        "block_len_per_layer",
        "dcp_size",
        "host_buffer_kv_cache_layout",
        "kv_cache_config",
        "kv_cache_layout",
        "kv_transfer_config",
        "pp_size",
        "tp_rank",
        "use_host_buffer",
        "use_mla",
        "vllm_config",
        "world_size",
        "xfer_stats",
    ),
    worker_registered_state=(),
    connector_overrides=(
        "build_connector_meta",
        "build_kv_connector_stats",
        "build_prom_metrics",
        "on_new_request",
        "request_finished",
        "request_finished_all_groups",
        "update_state_after_alloc",
    ),
    scheduler_overrides=(),
    scheduler_state=(),
)


def require(
    owner: object,
    names: Iterable[str],
    *,
    owner_name: str,
    release: str,
    below: type | None = None,
) -> None:
    """Raise ``UpstreamDriftError`` naming every one of ``names`` that
    ``owner`` (an upstream class, module or instance) does not have. With
    ``below`` (an abstract interface ``owner`` implements), a name counts only
    where a class between ``owner`` and ``below`` defines it: the interface's
    abstract method is not upstream's implementation."""
    if below is None:
        missing = [name for name in names if not hasattr(owner, name)]
    else:
        implementers = [cls for cls in owner.__mro__ if cls is not below and issubclass(cls, below)]
        missing = [name for name in names if not any(name in vars(cls) for cls in implementers)]
    if missing:
        from vllm_nixl_hma._compat import installed_vllm_version

        raise UpstreamDriftError(release, owner_name, missing, installed_vllm_version())


@contextlib.contextmanager
def names_swapped(owner: object, replacements: Mapping[str, object]) -> Iterator[None]:
    """While the block runs, ``owner``'s attributes named in ``replacements``
    are those values (how the glue hands upstream's constructor our pieces);
    each is put back on every exit."""
    previous = {name: getattr(owner, name) for name in replacements}
    for name, value in replacements.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(owner, name, value)
