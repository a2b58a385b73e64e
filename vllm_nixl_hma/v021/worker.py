"""``NixlHMAConnectorWorker``: vLLM's NIXL worker with the hybrid block mapping fixed.

Ledger of departures from vLLM 0.21.0 ``NixlConnectorWorker``
(vllm/distributed/kv_transfer/kv_connector/v1/nixl/worker.py). Every other
method, and every byte of data movement, is upstream's.

``_logical_to_remote_kernel_block_ids(block_ids, remote_physical_per_logical)``
    Why: upstream multiplies remote logical ids by the remote ratio but adds
    the LOCAL ratio's offsets; with heterogeneous TP on a Mamba hybrid the
    ratios differ and decode silently reads the wrong kernel blocks
    (docs/design.md section 3). How: ``blocks.logical_to_kernel_ids_by_group`` with
    the remote ratio as multiplier and run length. Related: vLLM 0.22.0's fix.
    Remove when: the supported vLLM range starts at a release with the fix.

``_apply_prefix_caching(local_block_ids, remote_block_ids, remote_physical_per_logical)``
    Why: upstream 0.21.0 has no such method; its ``_read_blocks`` pairs the
    local list with the remote tail and asserts local <= remote, which pairs
    the wrong blocks (or asserts) when the two sides round the prompt up to
    logical blocks of different sizes. How: ``blocks.align_kernel_ids_by_group``.
    Remove when: as above (0.22.0 extracted a method of this name).

``_read_blocks(read_spec, dst_engine_id, request_id, remote_request_id, ...)``
    Why: to align the lists before upstream builds descriptors. How: align,
    then call upstream's ``_read_blocks`` with lists of equal length, so its
    own trimming is a no-op; a request whose lists cannot be aligned is
    failed before any byte is read. Remove when: as above.

``__init__(vllm_config, engine_id, kv_cache_config)``
    Why: upstream's ``derive_mamba_conv_split`` (called from its constructor)
    describes only Mamba2's x/B/C conv parts and raises NotImplementedError
    for every other state type, so a GatedDeltaNet hybrid (Qwen3-Next,
    Qwen3.5) cannot start. How: while upstream's constructor runs, that name
    in upstream's worker module answers ``derive_state_split``: a
    ``StateSplit`` from ``mamba_conv``'s state model of the model's config,
    checked against the shapes vLLM's layer reports; a state type
    ``mamba_conv`` does not describe is refused with ``UnsupportedModelError``.
    Any other worker in the process keeps upstream's function. Remove when:
    upstream moves GatedDeltaNet state (vLLM 0.33 does).

``add_remote_agent(nixl_agent_meta, remote_tp_rank, remote_tp_size)`` and
``_build_mamba_remote(nixl_agent_meta, tp_ratio, transfer_info)``
    Why: upstream takes the remote offsets of the conv parts from
    ``MambaConvSplitInfo``, which cannot describe q/k/v (v differs in size
    from k), and places B and C as if SSM groups were always sharded: when
    the model has fewer groups than the larger TP (vLLM then replicates the
    single group on every rank), B and C arrive wrong whenever prefill and
    decode TP differ, in both directions (docs/design.md section 4; still so in
    vLLM 0.33.0). How: ``add_remote_agent`` records which remote rank is
    being added; ``_build_mamba_remote`` builds upstream's descriptor list
    (per layer: each conv part for every block, then the SSM state) with
    offsets from ``mamba_conv.conv_read_plan`` and ``ssm_read_plan``, derived
    from vLLM's own weight-loading rules, and checks the remote's conv bytes.
    Local descriptors stay upstream's (``_build_mamba_local`` reads
    ``StateSplit.local_conv_offsets``). Remove when: upstream reads
    GatedDeltaNet and replicated groups right.

``register_kv_caches(kv_caches)`` and
``_nixl_handshake(host, port, remote_tp_size, expected_engine_id)``
    Why: upstream's decode side classifies the remote's memory with its own
    local layout and turns several mismatches into bare asserts, some after the
    remote agent is registered. How: prefill publishes a versioned
    ``handshake.HandshakeRecord`` beside vLLM's payload fields;
    ``_nixl_handshake`` (re-implemented from its contract: query each target
    rank on the side channel, check the compatibility hash and engine id,
    register the agent) first checks vLLM's compatibility hash as upstream
    does (upstream's message, upstream's ``enforce_handshake_compat`` escape
    hatch), then parses our record and refuses any mismatch, an other-version
    peer, or malformed metadata with a ``HandshakeError`` before
    ``add_remote_agent``. A stock peer (no record) is served when vLLM's
    metadata fixes every byte decode reads (``handshake.record_for_stock_peer``:
    equal ratio, kernel block size and KV layout) and refused naming the field
    otherwise. Remove when: upstream validates remote layouts itself.

``get_finished()`` and ``_handle_failed_transfer(req_id, handle)``, failures under HMA
    Why: with several KV cache groups upstream reports no invalid block for a
    request whose KV did not arrive (handshake refused, transfer setup or
    transfer failed): the request decodes on garbage (vLLM issue #52234).
    How: when vLLM runs ``vllm_nixl_hma.v021.scheduler``'s schedulers (the config
    hook selects them), every local block of such a request, in every group,
    is reported through ``get_block_ids_with_load_errors``; those schedulers
    then apply ``kv_load_failure_policy``. Remove when: upstream does both.

Forgetting a failed prefill engine (``_read_blocks``, ``_handle_failed_transfer``)
    Why: upstream keeps a remote engine's agents and descriptor lists after a
    transfer to it failed (a dead or restarted prefill engine), so they leak,
    and a restarted engine with the same id would be read with stale metadata.
    How: a failure marks the engine; at the end of the next ``get_finished``
    with no transfer from it in flight, its descriptor lists are released, its
    agents removed and its metadata dropped; the next request handshakes afresh.

The prefill lease (``start_load_kv``, ``_read_blocks_for_req``, ``get_finished``)
    Why: prefill frees and may reuse a request's blocks after
    ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``; upstream decode reads them anyway and
    decodes on another request's KV. How: a read is not started, and a
    finished read counts as failed, within ``lease_margin_s`` of the lease end
    prefill put in ``kv_transfer_params`` (``lease.py``). Remove when:
    upstream carries a lease.

``get_finished()``
    Why: upstream looks up the remote engine of every finished receive, and a
    request whose handshake failed names an engine that never registered: a
    KeyError that takes the decode worker down with one refused prefill engine.
    How: such requests are taken out first and reported finished (failed)
    without the lookup. Remove when: upstream tolerates them.

Requests sent only to notify prefill (``get_finished``, ``_read_blocks_for_req``)
    Why: vLLM also hands the worker requests with no local block in any group,
    only so that prefill is told to free its blocks: a full prefix-cache hit,
    or a request decode's serving layer finished with an error response (it
    then submits a pre-aborted copy with the same ``kv_transfer_params``, see
    ``notify_kv_transfer_request_rejected``). The scheduler has already freed
    them; reporting one as received fails its ``assert req_id in
    self.requests`` and kills the engine core. Upstream reports one when its
    handshake fails. How: such a request is never reported: not when its
    handshake fails, and the lease never fails it (nothing is read, the
    notification is still sent). Remove when: upstream drops failed
    notify-only requests.

Descriptors per run of whole pages (``add_remote_agent``, ``_read_blocks``, ``shutdown``)
    Why: upstream reads every kernel block of every layer with its own
    descriptor, two per page with a blocks-first layout (K and V), and NIXL's
    cost to prepare and post a read grows with the count (about 40 ns per
    descriptor in ``make_prepped_xfer`` alone on a CPU host). How: when decode
    reads whole pages of a remote rank (same TP, kernel block and page bytes),
    ``add_remote_agent`` also prepares lists with one descriptor per run of
    ``gcd(local ratio, remote ratio)`` pages per layer (``page_runs``), plus
    upstream's Mamba descriptors; ``_read_blocks`` uses them when every
    attention list is made of whole aligned runs, and upstream's lists
    otherwise. Same bytes, same notification. Remove when: upstream does so.

Reads spread over NIXL's threads (``__init__``)
    Why: NIXL's UCX backend posts a transfer of up to ``split_batch_size``
    descriptors (default 1024) on one thread and splits only longer ones over
    its ``num_threads`` threads; upstream's many small descriptors pass that
    mark, our run descriptors mostly do not, so a large read moved on one
    thread and was slower than upstream's (``read_threads`` has the numbers).
    How: while upstream's constructor runs, ``NixlWrapper`` in upstream's
    worker module builds the agent with UCX's ``split_batch_size`` set
    (``read_threads.DEFAULT_SPLIT_BATCH_SIZE`` unless
    ``kv_connector_extra_config`` sets it); an agent upstream configures
    without UCX threads (other backends, ``num_threads`` 0) is built as
    upstream builds it. Remove when: NIXL splits by bytes, or upstream sets it.

``_validate_remote_agent_handshake(nixl_agent_meta, remote_tp_size)``
    Why: upstream accepts a Mamba hybrid peer with another ratio while prefix
    caching is on, and the mismatch surfaces mid-request. How:
    ``blocks.check_alignable`` first, then upstream's checks. Remove when:
    as above.
"""

from __future__ import annotations

import copy
import functools
import threading
import time
from dataclasses import dataclass

import numpy as np

from vllm_nixl_hma import _compat
from vllm_nixl_hma._compat import require_adapter

require_adapter("v021", "vllm_nixl_hma.v021.worker")

from vllm.distributed.kv_transfer.kv_connector.utils import (  # noqa: E402
    BlockIds,
    EngineTransferInfo,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    worker as upstream_worker_module,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (  # noqa: E402
    GET_META_MSG,
    NixlAgentMetadata,
    NixlHandshakePayload,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import (  # noqa: E402
    ReadSpec,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import (  # noqa: E402
    NixlConnectorWorker,
)
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    KVCacheConfig,
    MambaSpec,
)

from vllm_nixl_hma import __version__  # noqa: E402
from vllm_nixl_hma.core import (  # noqa: E402
    blocks,
    handshake,
    lease,
    page_runs,
    read_threads,
    side_channel,
    upstream_contract,
)
from vllm_nixl_hma.core.errors import (  # noqa: E402
    BlockAlignmentError,
)
from vllm_nixl_hma.core.groups import group_kinds_of  # noqa: E402
from vllm_nixl_hma.core.state_split import (  # noqa: E402
    StateSplit,
    derive_state_split,
    remote_page_reads,
)

__all__ = [
    "NixlHMAConnectorWorker",
    "NixlHMAHandshakePayload",
    "build_nixl_agent",
    "group_kinds_of",
]

#: How long decode waits for each side-channel answer by default (as upstream:
#: 5 s); ``kv_connector_extra_config`` ``side_channel_timeout_s`` changes it.
SIDE_CHANNEL_TIMEOUT_S = 5.0
#: attribute of NixlConnectorMetadata with {request id: lease end} (connector.py)
LEASE_DEADLINES_ATTR = "vllm_nixl_hma_lease_deadlines"


@dataclass
class NixlHMAHandshakePayload(NixlHandshakePayload):
    """vLLM's payload plus our record. A subclass, so that vLLM's scheduler
    serves it unchanged; stock decoders ignore the extra field."""

    vllm_nixl_hma: bytes = b""


logger = init_logger(f"vllm.{__name__}")


@dataclass(frozen=True)
class PageRunList:
    """A prepared run descriptor list of one side (``page_runs``)."""

    handle: int
    run_blocks: int
    runs_per_layer: int
    num_layers: int
    logical_blocks: int

    @property
    def num_run_descs(self) -> int:
        """Where the Mamba descriptors start."""
        return self.num_layers * self.runs_per_layer


def build_nixl_agent(agent_cls, name: str, config, split_batch_size: int):
    """``agent_cls(name, config)`` (NIXL's ``nixl_agent``), with UCX's
    ``split_batch_size`` when ``config`` asks for UCX alone with threads;
    any other agent is built exactly as asked (see ``read_threads``), and so
    is one whose class cannot add a backend after it is built (``NixlWrapper``
    stand-ins, such as vLLM's own tests use)."""
    if (
        config is None
        or list(config.backends) != ["UCX"]
        or config.num_threads < 1
        or not callable(getattr(agent_cls, "create_backend", None))
    ):
        return agent_cls(name, config)
    without_backends = copy.copy(config)
    without_backends.backends = []
    agent = agent_cls(name, without_backends)
    agent.create_backend(
        "UCX", read_threads.ucx_backend_params(config.num_threads, split_batch_size)
    )
    return agent


class FailedRequests(set):
    """Upstream's ``_failed_recv_reqs`` with a lock. vLLM's handshake thread
    adds to it (``request_ready``, when a handshake fails) while the engine's
    step reads and clears it in ``get_finished``; ``add`` waits while
    ``get_finished`` holds ``lock`` (reentrant: the step adds too)."""

    def __init__(self, *items):
        super().__init__(*items)
        self.lock = threading.RLock()

    def add(self, item) -> None:
        with self.lock:
            super().add(item)


def _same_lengths(local_ids_by_group, remote_ids_by_group) -> bool:
    return len(local_ids_by_group) == len(remote_ids_by_group) and all(
        len(local) == len(remote)
        for local, remote in zip(local_ids_by_group, remote_ids_by_group, strict=True)
    )


class NixlHMAConnectorWorker(NixlConnectorWorker):
    """vLLM's ``NixlConnectorWorker`` with the departures listed in this module."""

    def __init__(self, vllm_config, engine_id: str, kv_cache_config: KVCacheConfig):
        """vLLM 0.21.0 ``NixlConnectorWorker.__init__``, with our description of
        the Mamba-type state in place of upstream's.

        Why: upstream's ``derive_mamba_conv_split`` raises
        ``NotImplementedError`` for every state but Mamba2, so a GatedDeltaNet
        hybrid (Qwen3-Next, Qwen3.5) cannot start. What changes: while
        upstream's constructor runs, that name in upstream's worker module
        answers ``derive_state_split`` (any other worker in the process keeps
        upstream's); ``_conv_decomp`` is then a ``StateSplit``. Remove when:
        upstream moves GatedDeltaNet state (vLLM 0.33 does).

        Also: upstream's ``NixlWrapper`` is ``build_nixl_agent`` meanwhile, so
        that a read of our run descriptors is spread over NIXL's threads (see
        the ledger); ``kv_connector_extra_config`` ``split_batch_size`` is
        checked here, before any agent exists.
        """
        contract = upstream_contract.V021
        nixl_note = _compat.untested_nixl()
        if nixl_note:
            logger.warning_once("NixlHMAConnector: %s", nixl_note)
        upstream_contract.require(
            NixlConnectorWorker,
            contract.worker_overrides + contract.worker_calls,
            owner_name="NixlConnectorWorker",
            release=contract.release,
        )
        upstream_contract.require(
            upstream_worker_module,
            contract.worker_module,
            owner_name=upstream_worker_module.__name__,
            release=contract.release,
        )
        extra_config = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None)
        split_batch_size = read_threads.split_batch_size_from(extra_config)

        def split_for_this_rank(mamba_spec, local_tp):
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return derive_state_split(
                vllm_config, mamba_spec, local_tp, get_tensor_model_parallel_rank()
            )

        upstream_split = upstream_worker_module.derive_mamba_conv_split
        upstream_agent_cls = upstream_worker_module.NixlWrapper

        def agent_spreading_reads(name, config):
            return build_nixl_agent(upstream_agent_cls, name, config, split_batch_size)

        upstream_worker_module.derive_mamba_conv_split = split_for_this_rank
        if upstream_agent_cls is not None:  # None: upstream refuses to start
            upstream_worker_module.NixlWrapper = agent_spreading_reads
        try:
            super().__init__(vllm_config, engine_id, kv_cache_config)
        finally:
            upstream_worker_module.derive_mamba_conv_split = upstream_split
            upstream_worker_module.NixlWrapper = upstream_agent_cls
        upstream_contract.require(
            self,
            contract.worker_state,
            owner_name="NixlConnectorWorker (after its constructor)",
            release=contract.release,
        )
        self._failed_recv_reqs = FailedRequests(self._failed_recv_reqs)

    @property
    def _state_split(self) -> StateSplit:
        if not isinstance(self._conv_decomp, StateSplit):
            raise RuntimeError("the worker has no Mamba-type state")
        return self._conv_decomp

    @functools.cached_property
    def _group_kinds(self) -> tuple[blocks.GroupKind, ...]:
        return group_kinds_of(self.kv_cache_config)

    def _logical_to_remote_kernel_block_ids(
        self, block_ids: BlockIds, remote_physical_per_logical: int
    ) -> BlockIds:
        """vLLM 0.21.0 ``NixlConnectorWorker._logical_to_remote_kernel_block_ids``.

        Why: upstream expands remote logical block ``L`` into
        ``L*remote_ratio .. L*remote_ratio + local_ratio - 1``, i.e. with the
        local ratio as run length. What changes: the remote ratio (from the
        remote's handshake metadata) is used for both; Mamba groups still pass
        through unchanged. Remove when: vLLM >= 0.22.0 is the minimum.
        """
        remote_logical_ids_by_group = block_ids
        if remote_physical_per_logical == 1:  # kernel ids are the logical ids
            return remote_logical_ids_by_group
        remote_kernel_ids_by_group = blocks.logical_to_kernel_ids_by_group(
            remote_logical_ids_by_group, self._group_kinds, remote_physical_per_logical
        )
        return [ids.tolist() for ids in remote_kernel_ids_by_group]

    def _apply_prefix_caching(
        self,
        local_block_ids: BlockIds,
        remote_block_ids: BlockIds,
        remote_physical_per_logical: int,
    ) -> tuple[BlockIds, BlockIds]:
        """Pair local and remote kernel block ids per group (no upstream
        counterpart in 0.21.0; named after vLLM 0.22.0's method).

        Both arguments hold kernel ids. With equal ratios 0.21.0's rule stays
        (the local list pairs with the remote tail after a local prefix-cache
        hit); with unequal ratios (Mamba hybrids under heterogeneous TP)
        leading blocks pair and the trailing rounding surplus is dropped.
        Raises ``BlockAlignmentError``.
        """
        local_kernel_ids_by_group, remote_kernel_ids_by_group = blocks.align_kernel_ids_by_group(
            local_block_ids,
            remote_block_ids,
            self._group_kinds,
            local_physical_per_logical=self._physical_blocks_per_logical_kv_block,
            remote_physical_per_logical=remote_physical_per_logical,
        )
        return (
            [ids.tolist() for ids in local_kernel_ids_by_group],
            [ids.tolist() for ids in remote_kernel_ids_by_group],
        )

    def _read_blocks(
        self,
        read_spec: ReadSpec,
        dst_engine_id: str,
        request_id: str,
        remote_request_id: str,
        local_xfer_side_handle: int,
        remote_xfer_side_handle: int,
    ):
        """vLLM 0.21.0 ``NixlConnectorWorker._read_blocks``.

        Why: upstream trims each remote group to the local count from the
        tail and asserts local <= remote, which is wrong when prefill and
        decode round the prompt to logical blocks of different sizes. What
        changes: the lists are aligned by ``_apply_prefix_caching`` first and
        upstream's ``_read_blocks`` gets lists of equal length (its trimming
        then keeps everything). Lists that cannot be aligned fail the request
        before anything is read, as upstream does with a failed transfer
        setup. Remove when: vLLM >= 0.22.0 is the minimum.
        """
        if request_id in self._failed_recv_reqs:
            return  # refused on another remote rank already: nothing more is read
        if not blocks.has_local_blocks(read_spec.local_block_ids):
            # nothing to read, only prefill to notify: upstream recognizes that
            # by an empty list (start_load_kv gave such a request empty groups)
            read_spec = ReadSpec(
                remote_rank=read_spec.remote_rank,
                local_block_ids=[],
                remote_block_ids=read_spec.remote_block_ids,
            )
        elif not _same_lengths(read_spec.local_block_ids, read_spec.remote_block_ids):
            # (equal lengths in every group pair index by index under every
            # rule, so the common case skips the conversions)
            if self.transfer_topo is None:
                raise RuntimeError("_read_blocks called before register_kv_caches")
            remote_info = self.transfer_topo.get_engine_info(dst_engine_id)
            try:
                local_kernel_ids_by_group, remote_kernel_ids_by_group = self._apply_prefix_caching(
                    read_spec.local_block_ids,
                    read_spec.remote_block_ids,
                    remote_info.remote_physical_blocks_per_logical,
                )
            except BlockAlignmentError as e:
                self._fail_unalignable_request(request_id, dst_engine_id, read_spec, e)
                return
            read_spec = ReadSpec(
                remote_rank=read_spec.remote_rank,
                local_block_ids=local_kernel_ids_by_group,
                remote_block_ids=remote_kernel_ids_by_group,
            )
        if self._read_page_runs(read_spec, dst_engine_id, request_id, remote_request_id):
            return
        super()._read_blocks(
            read_spec=read_spec,
            dst_engine_id=dst_engine_id,
            request_id=request_id,
            remote_request_id=remote_request_id,
            local_xfer_side_handle=local_xfer_side_handle,
            remote_xfer_side_handle=remote_xfer_side_handle,
        )
        if request_id in self._failed_recv_reqs:  # upstream could not set the read up
            self._forget_remote_engine(dst_engine_id)

    # ------------------------------------------------- descriptors per page run

    @functools.cached_property
    def _page_run_locals(self) -> dict[int, PageRunList]:
        """{run_blocks: this rank's run descriptor list}"""
        return {}

    @functools.cached_property
    def _page_run_remotes(self) -> dict[str, dict[int, PageRunList]]:
        """{remote engine id: {remote rank: its run descriptor list}}"""
        return {}

    def _prepare_page_runs(
        self,
        nixl_agent_meta: NixlAgentMetadata,
        remote_tp_rank: int,
        remote_tp_size: int,
        remote_agent_name: str,
    ) -> None:
        """Prepare run descriptor lists for a remote rank decode reads whole
        pages of (``page_runs``); without them reads use upstream's lists."""
        engine_id = nixl_agent_meta.engine_id
        if remote_tp_rank in self._page_run_remotes.get(engine_id, {}):
            return
        if self.transfer_topo is None:
            return
        tp_ratio = self.transfer_topo.tp_ratio(remote_tp_size)
        run_blocks = page_runs.run_blocks_for(
            self._physical_blocks_per_logical_kv_block,
            nixl_agent_meta.physical_blocks_per_logical_kv_block,
        )
        blocks_first = self.transfer_topo.is_kv_layout_blocks_first
        layers = range(len(self.block_len_per_layer))
        read_bytes = [
            self.get_backend_aware_kv_block_len(i, first_split=True)
            + (self.get_backend_aware_kv_block_len(i, first_split=False) if blocks_first else 0)
            for i in layers
        ]
        refusal = page_runs.whole_page_refusal(
            tp_ratio=tp_ratio,
            block_size_ratio=self.transfer_topo.block_size_ratio(nixl_agent_meta.block_size),
            local_page_bytes=self.block_len_per_layer,
            remote_page_bytes=nixl_agent_meta.block_lens,
            local_read_bytes_per_page=read_bytes,
            descs_per_page=2 if blocks_first else 1,
            run_blocks=run_blocks,
        )
        if refusal is not None:
            logger.debug(
                "NixlHMAConnector: reads from %s use vLLM's descriptors: %s", engine_id, refusal
            )
            return
        try:
            self._page_run_local(run_blocks)  # made once per run length
            remote_descs = page_runs.page_run_descs(
                nixl_agent_meta.kv_caches_base_addr,
                nixl_agent_meta.block_lens,
                nixl_agent_meta.num_blocks,
                run_blocks,
                nixl_agent_meta.device_id,
            )
            remote_ratio = nixl_agent_meta.physical_blocks_per_logical_kv_block
            if self._has_mamba:
                transfer_info = self.transfer_topo.get_engine_info(engine_id)
                mamba = self._build_mamba_remote(nixl_agent_meta, tp_ratio, transfer_info)
                remote_descs = np.concatenate([remote_descs, np.asarray(mamba, dtype=np.int64)])
            handle = self.nixl_wrapper.prep_xfer_dlist(
                remote_agent_name,
                self.nixl_wrapper.get_xfer_descs(remote_descs, self.nixl_memory_type),
            )
        except Exception as e:  # NIXL refused the list: upstream's lists still work
            logger.warning(
                "NixlHMAConnector: could not prepare run descriptors for engine %s (%s); "
                "reads from it use vLLM's descriptors",
                engine_id,
                e,
            )
            return
        self._page_run_remotes.setdefault(engine_id, {})[remote_tp_rank] = PageRunList(
            handle=handle,
            run_blocks=run_blocks,
            runs_per_layer=nixl_agent_meta.num_blocks // run_blocks,
            num_layers=len(nixl_agent_meta.kv_caches_base_addr),
            logical_blocks=nixl_agent_meta.num_blocks // remote_ratio,
        )

    def _page_run_local(self, run_blocks: int) -> PageRunList:
        """This rank's run descriptor list for ``run_blocks`` (made once)."""
        if run_blocks not in self._page_run_locals:
            base_addrs = self.kv_caches_base_addr[self.engine_id][self.tp_rank]
            descs = page_runs.page_run_descs(
                base_addrs, self.block_len_per_layer, self.num_blocks, run_blocks, self.device_id
            )
            if self._has_mamba:
                mamba = self._build_mamba_local(base_addrs, 1)
                descs = np.concatenate([descs, np.asarray(mamba, dtype=np.int64)])
            handle = self.nixl_wrapper.prep_xfer_dlist(
                "NIXL_INIT_AGENT", self.nixl_wrapper.get_xfer_descs(descs, self.nixl_memory_type)
            )
            self._page_run_locals[run_blocks] = PageRunList(
                handle=handle,
                run_blocks=run_blocks,
                runs_per_layer=self.num_blocks // run_blocks,
                num_layers=len(base_addrs),
                logical_blocks=self._logical_num_blocks,
            )
        return self._page_run_locals[run_blocks]

    def _read_page_runs(
        self,
        read_spec: ReadSpec,
        dst_engine_id: str,
        request_id: str,
        remote_request_id: str,
    ) -> bool:
        """Post the read with run descriptors, if this remote rank has them
        and every attention list is made of whole aligned runs on both sides;
        ``False`` leaves the read to upstream's descriptors."""
        remote = self._page_run_remotes.get(dst_engine_id, {}).get(read_spec.remote_rank)
        if remote is None or not any(len(ids) for ids in read_spec.local_block_ids):
            return False
        local = self._page_run_locals[remote.run_blocks]
        if any(
            len(local_ids) != len(remote_ids)
            for local_ids, remote_ids in zip(
                read_spec.local_block_ids, read_spec.remote_block_ids, strict=True
            )
        ):
            return False
        sides = []
        for run_list, ids_by_group, buffer_name in (
            (local, read_spec.local_block_ids, "local"),
            (remote, read_spec.remote_block_ids, "remote"),
        ):
            desc_ids = page_runs.request_desc_ids(
                [
                    (kind is blocks.GroupKind.MAMBA, np.asarray(ids, dtype=np.int64))
                    for kind, ids in zip(self._group_kinds, ids_by_group, strict=True)
                ],
                run_blocks=remote.run_blocks,
                num_layers=run_list.num_layers,
                runs_per_layer=run_list.runs_per_layer,
                logical_blocks=run_list.logical_blocks,
                buffer=self._desc_id_buffers.get(buffer_name),
            )
            if desc_ids is None:
                return False
            self._desc_id_buffers[buffer_name] = desc_ids.base  # a view of the buffer
            sides.append((run_list.handle, desc_ids))
        self._post_read(request_id, dst_engine_id, read_spec.remote_rank, remote_request_id, *sides)
        return True

    @functools.cached_property
    def _desc_id_buffers(self) -> dict[str, np.ndarray]:
        """Reused int32 id arrays, one per side (NIXL copies the ids it is given)."""
        return {}

    def _post_read(
        self,
        request_id: str,
        dst_engine_id: str,
        remote_rank: int,
        remote_request_id: str,
        local_side: tuple[int, np.ndarray],
        remote_side: tuple[int, np.ndarray],
    ) -> None:
        """One NIXL READ with prefill's notification, as upstream posts its
        reads; a failure to set it up fails the request before any byte moves."""
        notif_msg = f"{remote_request_id}:{self.world_size}".encode()
        handle = None
        try:
            handle = self.nixl_wrapper.make_prepped_xfer(
                "READ",
                local_side[0],
                local_side[1],
                remote_side[0],
                remote_side[1],
                notif_msg=notif_msg,
            )
            self.nixl_wrapper.transfer(handle)
        except Exception as e:
            self._log_failure(
                failure_type="transfer_setup_failed",
                req_id=request_id,
                msg="Marking blocks as invalid",
                error=e,
                dst_engine_id=dst_engine_id,
                remote_rank=remote_rank,
            )
            if handle is not None:
                self.nixl_wrapper.release_xfer_handle(handle)
            meta = self._recving_metadata.get(request_id)
            if meta is not None and not self._is_hma_required:
                self._invalid_block_ids.update(meta.local_block_ids[0])
            self.xfer_stats.record_failed_transfer()
            self._failed_recv_reqs.add(request_id)
            self._forget_remote_engine(dst_engine_id)
            return
        self._recving_transfers[request_id].append(handle)

    def _fail_unalignable_request(
        self,
        request_id: str,
        dst_engine_id: str,
        read_spec: ReadSpec,
        error: BlockAlignmentError,
    ) -> None:
        """Mark a request failed without reading, as upstream marks a request
        whose transfer setup failed."""
        self._log_failure(
            failure_type="block_alignment_failed",
            req_id=request_id,
            msg="Local and remote block lists cannot be paired; nothing was read",
            error=error,
            dst_engine_id=dst_engine_id,
            remote_rank=read_spec.remote_rank,
        )
        self.xfer_stats.record_failed_transfer()
        self._failed_recv_reqs.add(request_id)

    def _validate_remote_agent_handshake(
        self, nixl_agent_meta: NixlAgentMetadata, remote_tp_size: int
    ):
        """vLLM 0.21.0 ``NixlConnectorWorker._validate_remote_agent_handshake``.

        Why: upstream accepts a peer whose kernel-per-logical ratio differs
        from ours while prefix caching is on (or with sliding-window groups);
        such blocks cannot be paired and the request would fail or corrupt
        mid-flight.
        What changes: ``blocks.check_alignable`` raises
        ``IncompatibleRemoteError`` (a RuntimeError naming both ratios and
        --no-enable-prefix-caching) before upstream's own checks run.
        Remove when: vLLM >= 0.22.0 is the minimum.
        """
        blocks.check_alignable(
            self._group_kinds,
            local_physical_per_logical=self._physical_blocks_per_logical_kv_block,
            remote_physical_per_logical=nixl_agent_meta.physical_blocks_per_logical_kv_block,
            local_prefix_caching=bool(self.vllm_config.cache_config.enable_prefix_caching),
        )
        super()._validate_remote_agent_handshake(nixl_agent_meta, remote_tp_size)

    def add_remote_agent(
        self,
        nixl_agent_meta: NixlAgentMetadata,
        remote_tp_rank: int = 0,
        remote_tp_size: int = 1,
    ) -> str:
        """vLLM 0.21.0 ``NixlConnectorWorker.add_remote_agent``, unchanged but
        for recording ``remote_tp_rank`` for ``_build_mamba_remote``, which
        upstream calls without it."""
        self._remote_tp_rank_being_added = remote_tp_rank
        try:
            remote_agent_name = super().add_remote_agent(
                nixl_agent_meta, remote_tp_rank, remote_tp_size
            )
            self._prepare_page_runs(
                nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_agent_name
            )
            return remote_agent_name
        finally:
            self._remote_tp_rank_being_added = None

    def _build_mamba_remote(
        self,
        nixl_agent_meta: NixlAgentMetadata,
        tp_ratio: int,
        transfer_info: EngineTransferInfo,
    ) -> list[tuple[int, int, int]]:
        """vLLM 0.21.0 ``NixlConnectorWorker._build_mamba_remote``, rewritten.

        Why: upstream's offsets come from ``MambaConvSplitInfo``, which knows
        only Mamba2's x/B/C (and so cannot serve GatedDeltaNet's q/k/v, whose
        v differs in size from k) and places B and C as if SSM groups were
        always sharded (wrong for a replicated group under unequal TP). What
        changes: the same descriptor list (per layer: each conv part for every
        block, then the SSM state for every block), with offsets from
        ``mamba_conv.conv_read_plan`` / ``ssm_read_plan`` for this decode rank
        and the remote rank being added (``add_remote_agent``). Remove when:
        upstream reads GatedDeltaNet and replicated groups right.
        """
        reads = remote_page_reads(
            self._state_split,
            transfer_info.remote_tp_size,
            self._remote_tp_rank_being_added,
            self.world_size,
            self.tp_rank,
            nixl_agent_meta.ssm_sizes[0],
        )
        remote_physical_per_logical = transfer_info.remote_physical_blocks_per_logical
        num_blocks = nixl_agent_meta.num_blocks // remote_physical_per_logical
        device_id = nixl_agent_meta.device_id
        descs: list[tuple[int, int, int]] = []
        for layer, base_addr in enumerate(nixl_agent_meta.kv_caches_base_addr):
            page_stride = nixl_agent_meta.block_lens[layer] * remote_physical_per_logical
            for offset_bytes, size_bytes in reads:
                descs.extend(
                    (base_addr + block * page_stride + offset_bytes, size_bytes, device_id)
                    for block in range(num_blocks)
                )
        return descs

    def register_kv_caches(self, kv_caches):
        """vLLM 0.21.0 ``NixlConnectorWorker.register_kv_caches``, then our record.

        Why: decode needs prefill's layout as prefill states it. What changes:
        after upstream registers the caches and builds its payload, the payload
        is re-wrapped as ``NixlHMAHandshakePayload`` carrying this worker's
        ``HandshakeRecord``. Remove when: upstream carries an equivalent.
        """
        super().register_kv_caches(kv_caches)
        upstream_contract.require(
            self,
            upstream_contract.V021.worker_registered_state,
            owner_name="NixlConnectorWorker (after register_kv_caches)",
            release=upstream_contract.V021.release,
        )
        self._handshake_record = self._build_handshake_record(kv_caches)
        payload = self.xfer_handshake_metadata
        self.xfer_handshake_metadata = NixlHMAHandshakePayload(
            compatibility_hash=payload.compatibility_hash,
            agent_metadata_bytes=payload.agent_metadata_bytes,
            vllm_nixl_hma=handshake.encode_record(self._handshake_record),
        )

    def _build_handshake_record(self, kv_caches) -> handshake.HandshakeRecord:
        local_physical_per_logical = self._physical_blocks_per_logical_kv_block
        groups = [
            handshake.GroupRecord(
                kind.value, local_physical_per_logical if kind.is_attention else 1
            )
            for kind in self._group_kinds
        ]
        # The regions upstream registers, in its order (register_kv_caches).
        regions_mamba: list[bool] = []
        seen: set[int] = set()
        xfer_buffers = self.host_xfer_buffers if self.use_host_buffer else kv_caches
        for layer_name, cache_or_caches in xfer_buffers.items():
            layer_spec = self._layer_specs[layer_name]
            regions = self.transfer_topo.get_transfer_cache_regions(cache_or_caches, layer_spec)
            for region in regions:
                if region.data_ptr() in seen:
                    continue
                seen.add(region.data_ptr())
                regions_mamba.append(isinstance(layer_spec, MambaSpec))
        specs = [g.kv_cache_spec for g in self.kv_cache_config.kv_cache_groups]
        attention_dtypes = [str(s.dtype) for s in specs if hasattr(s, "dtype")]
        mamba_dtypes = next(
            ([str(d) for d in s.dtypes] for s in specs if isinstance(s, MambaSpec)), []
        )
        conv_layout = ""
        if self._has_mamba:
            from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

            conv_layout = "DS" if is_conv_state_dim_first() else "SD"
        cache_config = self.vllm_config.cache_config
        return handshake.HandshakeRecord(
            protocol=handshake.PROTOCOL,
            version=handshake.RECORD_VERSION,
            plugin_version=__version__,
            groups=groups,
            kernel_block_tokens=int(self.block_size),
            logical_block_tokens=int(self.block_size) * local_physical_per_logical,
            regions_mamba=regions_mamba,
            kv_cache_layout=self.kv_cache_layout
            if not self.use_host_buffer
            else self.host_buffer_kv_cache_layout,
            kv_cache_dtype=attention_dtypes[0] if attention_dtypes else "",
            mamba_state_dtypes=mamba_dtypes,
            mamba_conv_state_layout=conv_layout,
            prefix_caching=bool(cache_config.enable_prefix_caching),
            mamba_cache_mode=str(cache_config.mamba_cache_mode),
            tp_size=int(self.world_size),
        )

    def _nixl_handshake(
        self,
        host: str,
        port: int,
        remote_tp_size: int,
        expected_engine_id: str,
    ) -> dict[int, str]:
        """vLLM 0.21.0 ``NixlConnectorWorker._nixl_handshake``, re-implemented
        from its contract: ask each remote TP rank this rank reads from for its
        payload on the side channel, refuse an incompatible one, register the
        agent, return ``{remote rank: agent name}``.

        Why: upstream decodes only vLLM's fields, so it cannot refuse a
        mismatched peer before registering it. What changes: after upstream's
        compatibility-hash check (same message, same escape hatch), the
        payload is parsed by ``handshake.parse_payload``, the record (a stock
        peer's from ``handshake.record_for_stock_peer``) validated by
        ``handshake.validate_remote`` and the agent metadata by
        ``handshake.check_agent_metadata``, all before ``add_remote_agent``;
        and an unanswered query is asked again on a new socket within the
        side-channel timeout (``side_channel``), where upstream waits once;
        every socket comes from upstream's ``zmq_ctx`` as upstream's does.
        Remove when: upstream validates remote layouts itself.
        """
        import msgspec
        import zmq
        from vllm.utils.network_utils import make_zmq_path

        if not self.use_host_buffer:
            # the background thread needs a device context (see upstream)
            upstream_worker_module.current_platform.set_device(self.device_id)
        if self.transfer_topo is None:
            raise RuntimeError("_nixl_handshake called before register_kv_caches")
        remote_ranks = self.transfer_topo.handshake_target_ranks(remote_tp_size)
        path = make_zmq_path("tcp", host, port)
        agent_names: dict[int, str] = {}
        for remote_rank in remote_ranks:
            started = time.perf_counter()
            payload_bytes = side_channel.ask(
                path,
                msgspec.msgpack.encode((GET_META_MSG, remote_rank)),
                self._side_channel_timeout_s,
                on_retry=lambda attempt, waited_s, rank=remote_rank: logger.warning(
                    "NixlHMAConnector: no answer from %s for rank %s within %.1f s "
                    "(attempt %d); asking again on a new socket",
                    path,
                    rank,
                    waited_s,
                    attempt + 1,
                ),
                # upstream's own socket helper, looked up at call time as upstream does
                open_socket=lambda p: upstream_worker_module.zmq_ctx(zmq.REQ, p),
            )
            if payload_bytes is None:
                raise handshake.HandshakeError(
                    "side channel",
                    f"an answer within {self._side_channel_timeout_s:g} s",
                    f"no answer from {path} for rank {remote_rank}",
                    "check that the prefill engine is up and "
                    "VLLM_NIXL_SIDE_CHANNEL_HOST/PORT point at it",
                )
            agent_meta = self._validated_agent_metadata(
                payload_bytes, expected_engine_id, remote_tp_size
            )
            agent_names[remote_rank] = self.add_remote_agent(
                agent_meta, remote_rank, remote_tp_size
            )
            logger.debug(
                "NIXL handshake with %s rank %s took %.3f s",
                expected_engine_id,
                remote_rank,
                time.perf_counter() - started,
            )
        return agent_names

    def _validated_agent_metadata(
        self, payload_bytes: bytes, expected_engine_id: str, remote_tp_size: int
    ) -> NixlAgentMetadata:
        import msgspec

        parsed = handshake.parse_payload(payload_bytes)
        if self.compat_hash is None:
            raise RuntimeError("compatibility hash is computed in register_kv_caches")
        # upstream's check first, with upstream's message and escape hatch
        if self.enforce_compat_hash and parsed.compatibility_hash != self.compat_hash:
            raise handshake.CompatibilityHashMismatch(self.compat_hash, parsed.compatibility_hash)
        if parsed.record is not None:
            handshake.validate_remote(self._handshake_record, parsed.record)
            if parsed.record.tp_size != remote_tp_size:
                raise handshake.HandshakeError(
                    "tp_size",
                    remote_tp_size,
                    parsed.record.tp_size,
                    "the request's kv_transfer_params name another TP size than the "
                    "prefill engine reports",
                )
        try:
            agent_meta = msgspec.msgpack.decode(parsed.agent_metadata_bytes, type=NixlAgentMetadata)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise handshake.MalformedHandshakeError(
                "agent_metadata_bytes", len(parsed.agent_metadata_bytes), str(e)
            ) from e
        if agent_meta.engine_id != expected_engine_id:
            raise handshake.HandshakeError(
                "engine_id",
                expected_engine_id,
                agent_meta.engine_id,
                "the side channel answered for another engine",
            )
        record = parsed.record
        if record is None:
            record = handshake.record_for_stock_peer(
                self._handshake_record,
                remote_tp_size=remote_tp_size,
                block_size=agent_meta.block_size,
                physical_blocks_per_logical=agent_meta.physical_blocks_per_logical_kv_block,
                kv_cache_layout=agent_meta.kv_cache_layout,
            )
            handshake.validate_remote(self._handshake_record, record)
            logger.warning(
                "NixlHMAConnector: prefill engine %s runs stock NixlConnector; served, "
                "since its metadata fixes every byte decode reads (no lease: its blocks "
                "are read whenever decode gets to them)",
                expected_engine_id,
            )
        handshake.check_agent_metadata(
            record,
            num_blocks=agent_meta.num_blocks,
            block_lens=agent_meta.block_lens,
            kv_caches_base_addr=agent_meta.kv_caches_base_addr,
            block_size=agent_meta.block_size,
            physical_blocks_per_logical=agent_meta.physical_blocks_per_logical_kv_block,
            ssm_sizes=list(agent_meta.ssm_sizes),
        )
        return agent_meta

    def get_finished(self) -> tuple[set[str], set[str]]:
        """vLLM 0.21.0 ``NixlConnectorWorker.get_finished``.

        Why: upstream raises KeyError on a failed request whose remote engine
        never registered (refused or unreachable at handshake), and under HMA
        reports no invalid block for any failed request. What changes: each
        failed request, taken once from a snapshot of ``_failed_recv_reqs``
        (the handshake thread adds to it), has its blocks reported invalid;
        those of unregistered engines are removed from ``_failed_recv_reqs``
        and ``_recving_metadata`` before upstream runs and added to its
        ``done_recving``. All of it, upstream's part too, runs holding
        ``FailedRequests.lock``: a handshake that fails meanwhile waits to add
        its request, which the next call takes (without the lock, upstream
        met such a request unprepared and raised the KeyError anyway: twice
        in the fault test's dead-side-channel case). Remove when: upstream
        does both.
        """
        failed = self._failed_recv_reqs
        if not isinstance(failed, FailedRequests):  # a worker built without our constructor
            failed = self._failed_recv_reqs = FailedRequests(failed)
        with failed.lock:
            done_sending, done_recving, unregistered = self._get_finished_locked()
        self._release_failed_engines()
        return done_sending, done_recving | unregistered

    def _get_finished_locked(self) -> tuple[set[str], set[str], set[str]]:
        unregistered = set()
        # A failed request whose read from another remote rank is still in
        # flight is reported once that read ends (upstream's own pass then
        # reports it): reported now as well, it came back finished a second
        # time and upstream's "not found in recving_metadata" assert took the
        # engine down (unpairable lists on one rank of a TP 2 prefill).
        held = {
            rid: self._recving_metadata.get(rid)
            for rid in self._failed_recv_reqs
            if self._recving_transfers.get(rid)
        }
        self._failed_recv_reqs.difference_update(held)
        for request_id in tuple(self._failed_recv_reqs):
            if not self._kv_awaited(request_id):
                # the scheduler freed it already (see the ledger)
                self._failed_recv_reqs.discard(request_id)
                self._recving_metadata.pop(request_id, None)
                self._lease_deadlines.pop(request_id, None)
                continue
            self._report_invalid_blocks_of(request_id)
            self._lease_deadlines.pop(request_id, None)
            meta = self._recving_metadata.get(request_id)
            if (
                meta is None
                or meta.remote is None
                or not self._engine_registered(meta.remote.engine_id)
            ):
                unregistered.add(request_id)
        self._failed_recv_reqs.difference_update(unregistered)
        for request_id in unregistered:
            self._recving_metadata.pop(request_id, None)
        done_sending, done_recving = super().get_finished()
        for request_id, meta in held.items():
            if request_id in done_recving:  # its last read ended: failed now
                self._report_invalid_blocks_of(request_id, meta)
            else:
                self._failed_recv_reqs.add(request_id)
        return done_sending, done_recving, unregistered

    def _kv_awaited(self, request_id: str) -> bool:
        """Whether vLLM's scheduler waits for this request's KV: not for one
        with no local block in any group, sent only to notify prefill (see
        the ledger)."""
        meta = self._recving_metadata.get(request_id)
        return meta is not None and blocks.has_local_blocks(meta.local_block_ids)

    def _engine_registered(self, engine_id: str) -> bool:
        if self.transfer_topo is None:
            return False
        try:
            self.transfer_topo.get_engine_info(engine_id)
        except KeyError:
            return False
        return True

    def _handle_failed_transfer(self, req_id: str, handle: int):
        """vLLM 0.21.0 ``NixlConnectorWorker._handle_failed_transfer``, plus
        the request's blocks in every group under HMA and forgetting the
        failed engine (see the ledger)."""
        self._report_invalid_blocks_of(req_id)
        super()._handle_failed_transfer(req_id, handle)
        meta = self._recving_metadata.get(req_id)
        if meta is not None and meta.remote is not None:
            self._forget_remote_engine(meta.remote.engine_id)

    def _forget_remote_engine(self, engine_id: str) -> None:
        """Mark a remote engine to be forgotten once nothing is in flight
        from it (see ``_release_failed_engines``)."""
        self.__dict__.setdefault("_failed_engine_ids", set()).add(engine_id)

    def _release_failed_engines(self) -> None:
        failed_engine_ids = self.__dict__.get("_failed_engine_ids")
        if not failed_engine_ids:
            return
        in_flight = {
            meta.remote.engine_id
            for request_id in self._recving_transfers
            if (meta := self._recving_metadata.get(request_id)) is not None
            and meta.remote is not None
        }
        for engine_id in tuple(failed_engine_ids - in_flight):
            failed_engine_ids.discard(engine_id)
            self._release_remote_engine(engine_id)

    def _release_remote_engine(self, engine_id: str) -> None:
        """Release what this worker holds for a remote engine, so that nothing
        leaks and the next request to it handshakes afresh."""
        with self._handshake_lock:
            for handle in self.dst_xfer_side_handles.pop(engine_id, {}).values():
                self.nixl_wrapper.release_dlist_handle(handle)
            for run_list in self._page_run_remotes.pop(engine_id, {}).values():
                self.nixl_wrapper.release_dlist_handle(run_list.handle)
            for agent_name in self._remote_agents.pop(engine_id, {}).values():
                self.nixl_wrapper.remove_remote_agent(agent_name)
            self.kv_caches_base_addr.pop(engine_id, None)
            self.dst_num_blocks.pop(engine_id, None)
            self.tp_mappings.pop(engine_id, None)
            if self.transfer_topo is not None:
                # upstream registers an engine once and never forgets it
                self.transfer_topo._engines.pop(engine_id, None)
        logger.warning(
            "NixlHMAConnector: a transfer from engine %s failed; its agents and "
            "descriptors are released and the next request will handshake again",
            engine_id,
        )

    @functools.cached_property
    def _scheduler_handles_multi_group_failures(self) -> bool:
        from vllm_nixl_hma.v021.scheduler import handles_multi_group_failures

        return handles_multi_group_failures(self.vllm_config.scheduler_config.scheduler_cls)

    def _report_invalid_blocks_of(self, request_id: str, meta=None) -> None:
        """Mark every local block of a failed request invalid, where the
        scheduler can take them: that is what makes vLLM 0.21.0's scheduler
        fail or recompute the request (a request reported received with no
        invalid block is decoded). Without HMA (one group: dense and
        sliding-window models on 0.21.0) upstream's scheduler takes them
        as they are; upstream marks group 0 itself at its own failure sites,
        but not at ours (the lease, unpairable lists), so they are marked
        here whatever the layout. With HMA only our schedulers can take
        several groups' blocks."""
        if self._is_hma_required and not self._scheduler_handles_multi_group_failures:
            logger.warning_once(
                "NixlHMAConnector: KV of a hybrid request did not arrive, and the configured "
                "scheduler cannot fail or recompute it; leave scheduler_cls unset to let "
                "vllm_nixl_hma select one that can"
            )
            return
        meta = meta or self._recving_metadata.get(request_id)
        if meta is None:
            return
        self._invalid_block_ids.update(
            block_id
            for group in meta.local_block_ids
            for block_id in group
            if block_id != 0  # vLLM's null block
        )

    @functools.cached_property
    def _side_channel_timeout_s(self) -> float:
        """How long to wait for each side-channel answer: upstream's fixed 5 s
        unless ``kv_connector_extra_config`` has ``side_channel_timeout_s`` (a
        loaded prefill engine can take longer to answer its first handshake)."""
        return float(
            self.kv_transfer_config.get_from_extra_config(
                "side_channel_timeout_s", SIDE_CHANNEL_TIMEOUT_S
            )
        )

    # ----------------------------------------------------------- prefill lease

    @functools.cached_property
    def _lease_margin_s(self) -> float:
        return float(
            self.kv_transfer_config.get_from_extra_config("lease_margin_s", lease.DEFAULT_MARGIN_S)
        )

    @functools.cached_property
    def _lease_deadlines(self) -> dict[str, float]:
        return {}

    def start_load_kv(self, metadata):
        """vLLM 0.21.0 ``NixlConnectorWorker.start_load_kv``, after noting the
        lease ends the scheduler side attached (see the ledger), and after
        giving a request with no local block one empty list per KV cache
        group: vLLM hands such a request (a notify-only copy) over with no
        group at all, and upstream's handshake-failure callback then raises
        ``IndexError`` on ``local_block_ids[0]`` before it adds the request
        to the failed set, so the request's metadata stayed behind forever.
        With empty groups the callback runs to its end and ``get_finished``
        drops the request (see the ledger); ``_read_blocks`` hands upstream
        the empty list it takes for "notify prefill only"."""
        deadlines = getattr(metadata, LEASE_DEADLINES_ATTR, None)
        if deadlines is not None:
            self._lease_deadlines.update(deadlines)
        elif getattr(metadata, "reqs_to_recv", None):
            # Our scheduler side always attaches the attribute (empty without a
            # lease): its absence means metadata from another connector, or a
            # vLLM that no longer carries our attribute to the worker.
            logger.warning_once(
                "NixlHMAConnector: the connector metadata carries no %s (not built by "
                "NixlHMAConnector's scheduler side, or this vLLM drops attributes on its way "
                "to the worker); reads are not checked against prefill's lease",
                LEASE_DEADLINES_ATTR,
            )
        config = getattr(self, "kv_cache_config", None)  # absent in workers built bare
        num_groups = max(len(getattr(config, "kv_cache_groups", ())), 1)
        for meta in getattr(metadata, "reqs_to_recv", {}).values():
            if not meta.local_block_ids:
                meta.local_block_ids = [[] for _ in range(num_groups)]
        super().start_load_kv(metadata)

    def _read_blocks_for_req(self, req_id: str, meta):
        """vLLM 0.21.0 ``NixlConnectorWorker._read_blocks_for_req``, unless the
        lease has run out: then nothing is read and the request fails. A
        request with no local block reads nothing and only notifies prefill:
        upstream's, lease or not."""
        deadline = self._lease_deadlines.get(req_id)
        if (
            deadline is not None
            and lease.expired(deadline, time.time(), self._lease_margin_s)
            and blocks.has_local_blocks(meta.local_block_ids)
        ):
            logger.error(
                "NixlHMAConnector: the prefill lease of request %s ended; its blocks may "
                "hold another request's KV, so they are not read",
                req_id,
            )
            self._failed_recv_reqs.add(req_id)
            return
        super()._read_blocks_for_req(req_id, meta)

    def _pop_done_transfers(self, transfers):
        """vLLM 0.21.0 ``NixlConnectorWorker._pop_done_transfers``; a read that
        finished past the lease has its blocks reported invalid (the request's
        metadata is still there at this point of ``get_finished``)."""
        done_request_ids = super()._pop_done_transfers(transfers)
        now = time.time()
        for request_id in done_request_ids:
            deadline = self._lease_deadlines.pop(request_id, None)
            if deadline is not None and lease.expired(deadline, now, self._lease_margin_s):
                logger.error(
                    "NixlHMAConnector: the read of request %s finished after its prefill "
                    "lease ended; its KV is not trusted",
                    request_id,
                )
                self._report_invalid_blocks_of(request_id)
        return done_request_ids

    def shutdown(self):
        """vLLM 0.21.0 ``NixlConnectorWorker.shutdown``, after releasing the
        run descriptor lists (``page_runs``) it does not know of."""
        if hasattr(self, "nixl_wrapper"):
            for run_list in self._page_run_locals.values():
                self.nixl_wrapper.release_dlist_handle(run_list.handle)
            for run_lists in self._page_run_remotes.values():
                for run_list in run_lists.values():
                    self.nixl_wrapper.release_dlist_handle(run_list.handle)
        self._page_run_locals.clear()
        self._page_run_remotes.clear()
        super().shutdown()
