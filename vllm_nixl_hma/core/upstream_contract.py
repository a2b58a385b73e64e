"""Which private names of vLLM's NIXL connector each release's glue relies on,
and the check that they are there, with the parameters the glue expects.

The glue subclasses vLLM's connector, worker and scheduler and calls or
replaces their private methods and reads their private state. A release that
renames one of them would not fail: an override of a method upstream no longer
calls is dead code, and a ``getattr(obj, name, default)`` turns a check off. A
release that adds a parameter to one of them would fail on the first call
(vLLM 0.34.0 passes ``_validate_remote_agent_handshake`` a fourth argument, an
override written for 0.33.0 takes three). So every such name is listed here,
per release and per upstream owner, and the worker, connector and scheduler
check them when they start: a missing name, a method whose parameters differ
from those of the release the glue was tested on (``signatures``; the
recorded ones are in ``vllm_nixl_hma/snapshots/``, written by ``vllm-nixl-hma
drift --record``), or another NIXL wire version stops startup with
``UpstreamDriftError`` naming the first mismatch.

Pure: no vLLM import; the glue passes the upstream objects in. The lists are
the contract; ``tests/unit/test_upstream_contract.py`` checks on each installed
release that every override the glue defines is listed (a new override must be
added here), that the recorded parameters are the installed release's, and
that removing a listed name or changing a signature stops startup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib import resources

from vllm_nixl_hma.core import signatures
from vllm_nixl_hma.core.errors import UpstreamDriftError

__all__ = [
    "CONTRACTS",
    "V021",
    "V033",
    "V034",
    "Contract",
    "installed",
    "names_swapped",
    "require",
    "require_signatures",
]

_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
#: where vLLM keeps ``NIXL_CONNECTOR_VERSION``, the handshake's wire version
WIRE_MODULE = f"{_NIXL}.metadata"


@dataclass(frozen=True)
class Contract:
    """One release's names, grouped by the upstream object that must have them."""

    release: str
    #: the upstream classes and module, by dotted path
    worker_class: str
    connector_class: str
    listener_class: str
    worker_module_path: str
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
    #: upstream methods our side-channel listener's scheduler overrides
    listener_overrides: tuple[str, ...] = (
        "_nixl_handshake_listener",
        "build_connector_meta",
        "set_xfer_handshake_metadata",
    )
    #: state the listener's upstream constructor sets, we read
    listener_state: tuple[str, ...] = ("_stop_event",)
    #: vLLM's scheduler class, where our scheduler overrides it (0.21.0)
    scheduler_class: str | None = None

    @functools.cached_property
    def snapshot(self) -> dict:
        """What ``vllm-nixl-hma drift --record`` read of this release: for
        each owner, each listed method's parameters and body digest."""
        name = f"vllm-{self.release}.json"
        return json.loads(resources.files("vllm_nixl_hma").joinpath("snapshots", name).read_text())

    def signature_of(self, owner: str, name: str) -> str:
        """The parameters of upstream's ``owner`` (``worker``, ``connector``,
        ``listener``, ``scheduler``) method ``name`` on the tested release."""
        return self.snapshot["owners"][owner]["methods"][name]["signature"]

    def require_worker_class(self, upstream_worker: type) -> None:
        """Before upstream's constructor: the methods we override or call,
        with the parameters they had on the tested release, and the wire
        version."""
        names = self.worker_overrides + self.worker_calls
        require(upstream_worker, names, owner_name=upstream_worker.__name__, release=self.release)
        self.require_signatures(upstream_worker, "worker", names)
        self.require_wire_version()

    def require_signatures(self, upstream: type, owner: str, names: Iterable[str]) -> None:
        """``UpstreamDriftError`` naming the first of ``names`` whose parameters
        on ``upstream`` differ from the tested release's."""
        require_signatures(
            upstream,
            {name: self.signature_of(owner, name) for name in names},
            owner_name=upstream.__name__,
            release=self.release,
        )

    def require_wire_version(self) -> None:
        """``UpstreamDriftError`` unless vLLM's ``NIXL_CONNECTOR_VERSION`` is the
        tested release's: a new one means the handshake's metadata changed."""
        import importlib

        module = importlib.import_module(WIRE_MODULE)
        expected = self.snapshot["wire_version"]
        found = getattr(module, "NIXL_CONNECTOR_VERSION", None)
        if found != expected:
            from vllm_nixl_hma._compat import installed_vllm_version

            raise UpstreamDriftError(
                self.release,
                WIRE_MODULE,
                [],
                installed_vllm_version(),
                changed=[("NIXL_CONNECTOR_VERSION", f" = {expected}", f" = {found}")],
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
        self.require_signatures(upstream_connector, "connector", self.connector_overrides)


V021 = Contract(
    release="0.21.0",
    worker_class=f"{_NIXL}.worker.NixlConnectorWorker",
    connector_class=f"{_NIXL}.connector.NixlConnector",
    listener_class=f"{_NIXL}.scheduler.NixlConnectorScheduler",
    worker_module_path=f"{_NIXL}.worker",
    scheduler_class="vllm.v1.core.sched.scheduler.Scheduler",
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
    worker_class=f"{_NIXL}.pull_worker.NixlPullConnectorWorker",
    connector_class=f"{_NIXL}.connector.NixlPullConnector",
    listener_class=f"{_NIXL}.pull_scheduler.NixlPullConnectorScheduler",
    worker_module_path=f"{_NIXL}.base_worker",
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
    # the progress thread's delay builds upstream's agent through it
    worker_module=("NixlWrapper",),
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

#: vLLM 0.34: the 0.33 glue's names, plus what the 0.34 glue overrides or reads
#: in addition (``v034.worker``'s ledger)
V034 = dataclasses.replace(
    V033,
    release="0.34.0",
    worker_overrides=tuple(sorted(V033.worker_overrides + ("_pair_blocks_by_last_token",))),
)

#: glue name -> its contract
CONTRACTS: dict[str, Contract] = {"v021": V021, "v033": V033, "v034": V034}


def installed() -> Contract:
    """The contract of the installed vLLM's glue (``_compat.adapter``)."""
    from vllm_nixl_hma import _compat

    return CONTRACTS[_compat.adapter()]


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


def require_signatures(
    owner: object, expected: Mapping[str, str], *, owner_name: str, release: str
) -> None:
    """Raise ``UpstreamDriftError`` naming each method of ``owner`` whose
    parameters (``signatures.of_function``) are not ``expected[name]``: an
    override written for the old ones would raise ``TypeError`` when
    upstream calls it, or a call of ours would pass the wrong arguments."""
    changed = []
    for name, wanted in expected.items():
        found = signatures.of_function(getattr(owner, name))
        if found != wanted:
            changed.append((name, wanted, found))
    if changed:
        from vllm_nixl_hma._compat import installed_vllm_version

        raise UpstreamDriftError(release, owner_name, [], installed_vllm_version(), changed=changed)


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
