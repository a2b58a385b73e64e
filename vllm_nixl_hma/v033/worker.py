"""``NixlHMAConnectorWorker`` for vLLM 0.33: upstream's pull worker with our departures.

Ledger of departures from vLLM 0.33.0's ``NixlPullConnectorWorker`` (each
override's docstring says what upstream does, why we depart, and when to
remove it):

* ``__init__``: builds this rank's ``StateSplit`` (``state_split``) beside
  upstream's ``MambaConvSplitInfo`` and refuses to start when the two
  disagree on where the local conv parts lie, since upstream's local
  descriptors come from its own. A state ``mamba_conv`` does not describe
  (Mamba1, MLA with SSM) keeps upstream's offsets, with a warning.
* ``add_remote_agent``: refuses a prefill rank decode cannot read before
  anything of it is registered or loaded (``handshake.refuse_before_loading``:
  layout, regions, Mamba state sizes, unequal kernel-per-logical ratios with
  prefix caching or sliding-window groups; each error names the field, the
  local and the remote value). Upstream loads the agent first and then
  checks, with asserts, and never compares state sizes or refuses a
  sliding-window group. Also records which prefill rank is being added, which
  upstream does not pass on to ``_build_mamba_remote``.
* ``_apply_prefix_caching``: a model without Mamba state read across unequal
  ratios (engines started with different ``--block-size``) pairs leading
  kernel blocks (``blocks.align_kernel_ids_by_group``); upstream pairs the
  decode list with prefill's tail, which shifts every block by the rounding
  surplus. Mamba hybrids keep upstream's rule (0.33 pairs them right).
* ``_read_blocks``: block lists that cannot be paired fail that one request
  (reported in ``failed_recving``) instead of raising out of
  ``start_load_kv``: upstream's pairing asserts run before its ``try``.
* ``_send_heartbeats``, ``_read_blocks_for_req``, ``_pop_done_transfers``:
  the prefill lease (``lease``). Prefill's glue exports its deadline; decode
  maps it onto its clock with upstream's handshake clock offset, extends it
  from the heartbeats it posted, and fails a request whose read would start,
  or did finish, within ``lease_margin_s`` of it. Upstream reads regardless
  (prefill only logs a late read, after its blocks may have been reused).
* ``_build_mamba_remote``: conv x/B/C and SSM offsets inside the prefill
  rank's page from ``mamba_conv``'s read plans. Upstream derives B and C as
  if SSM groups were always sharded, so a model with fewer groups than the
  larger TP (granite-4.0-h: one group) reads B and C from the wrong bytes at
  prefill TP 2 -> decode TP 1 and 1 -> 2 (measured: ``vllm-nixl-hma check
  --connector NixlConnector --layout hybrid-1group``).

Not redone (0.33 has it): the remote kernel-block expansion, failure
reporting per request, engine cleanup, GatedDeltaNet state splits (read
with our plans as well, which agree with upstream's for q/k/v).

Not ported from the 0.21.0 glue: descriptors per run of whole pages
(``page_runs``). vLLM 0.33 still hands NIXL one descriptor id per kernel
page, but the NIXL it requires (>= 1.5, for its strided lists) merges ids
that are contiguous on both sides in ``make_prepped_xfer``, so a logical
block's pages already move as one descriptor. A prototype of runs on 0.33
(N x 5 run lists beside upstream's) moved the same descriptors as stock and
posted no faster (``benchmarks/run.py``, tables ``harness`` and
``nixl_merge``; ``tests/v033/test_nixl_merge.py`` fails if NIXL stops
merging).
"""

from __future__ import annotations

import functools
import time

import numpy as np

from vllm_nixl_hma import _compat
from vllm_nixl_hma._compat import require_adapter

require_adapter("v033", "vllm_nixl_hma.v033.worker")

from vllm.distributed.kv_transfer.kv_connector.utils import (  # noqa: E402
    BlockIds,
    EngineTransferInfo,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (  # noqa: E402
    NixlAgentMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (  # noqa: E402
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import (  # noqa: E402
    ReadSpec,
)
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec  # noqa: E402

from vllm_nixl_hma.core import blocks, handshake, lease, upstream_contract  # noqa: E402
from vllm_nixl_hma.core.errors import BlockAlignmentError, UnsupportedModelError  # noqa: E402
from vllm_nixl_hma.core.groups import group_kinds  # noqa: E402
from vllm_nixl_hma.core.state_split import (  # noqa: E402
    StateSplit,
    derive_state_split,
    remote_page_reads,
    state_sizes,
)

__all__ = ["LEASE_EXTENSIONS_ATTR", "NixlHMAConnectorWorker"]

#: attribute of NixlConnectorMetadata: {remote request id: lease extension, s} (connector.py)
LEASE_EXTENSIONS_ATTR = "vllm_nixl_hma_lease_extensions"

logger = init_logger(f"vllm.{__name__}")


class NixlHMAConnectorWorker(NixlPullConnectorWorker):
    """vLLM 0.33's ``NixlPullConnectorWorker`` with the departures listed in this module."""

    # What __init__ sets, as defaults for a worker built without it (vLLM's own
    # tests build workers that way): no state split of ours, no rank being added.
    _split: StateSplit | None = None
    _remote_tp_rank_being_added: int | None = None
    _lease_margin_s: float = lease.DEFAULT_MARGIN_S

    def __init__(self, vllm_config, engine_id: str, kv_cache_config: KVCacheConfig):
        """vLLM 0.33.0 ``NixlPullConnectorWorker.__init__``, then our state split.

        Why: ``_build_mamba_remote`` below places remote reads with
        ``mamba_conv``, while upstream's ``_build_mamba_local`` places the
        local descriptors with its own ``MambaConvSplitInfo``; both must name
        the same bytes of the local page. What changes: after upstream's
        constructor, a Mamba hybrid gets ``_state_split`` for this rank, and
        its local conv offsets are compared with upstream's
        (``UnsupportedModelError`` if they differ, before any handshake). A
        model whose state ``mamba_conv`` does not describe (Mamba1, MLA with
        SSM, or a config whose dimensions do not give vLLM's state shapes)
        keeps upstream's offsets, with a warning: 0.33 moves those, and
        refusing them would take away what stock serves. Remove when:
        upstream reads replicated SSM groups right.
        """
        contract = upstream_contract.V033
        nixl_note = _compat.untested_nixl()
        if nixl_note:
            logger.warning_once("NixlHMAConnector: %s", nixl_note)
        contract.require_worker_class(NixlPullConnectorWorker)
        super().__init__(vllm_config, engine_id, kv_cache_config)
        contract.require_state(
            self, contract.worker_state, NixlPullConnectorWorker, "its constructor"
        )
        self._lease_margin_s = float(
            self.kv_transfer_config.get_from_extra_config("lease_margin_s", lease.DEFAULT_MARGIN_S)
        )
        if not self._has_mamba:
            return
        mamba_spec = next(
            spec for spec in self._layer_specs.values() if isinstance(spec, MambaSpec)
        )
        try:
            split = derive_state_split(vllm_config, mamba_spec, self.world_size, self.tp_rank)
        except UnsupportedModelError as e:
            logger.warning(
                "NixlHMAConnector: %s; its state is read at vLLM's own offsets, which are "
                "wrong for conv B and C of a model with fewer SSM groups than the larger TP",
                e,
            )
            return
        upstream_local = [(int(o), int(s)) for o, s in self._conv_decomp.local_conv_offsets]
        if split.local_conv_offsets != upstream_local or tuple(split.ssm_sizes) != tuple(
            int(s) for s in self._mamba_ssm_size
        ):
            raise UnsupportedModelError(
                f"{vllm_config.model_config.architecture} at TP {self.world_size}: the conv "
                f"parts lie at {split.local_conv_offsets} (state sizes {split.ssm_sizes}) by "
                f"the model's config, at {upstream_local} ({tuple(self._mamba_ssm_size)}) "
                "by vLLM's MambaConvSplitInfo"
            )
        self._split = split

    def add_remote_agent(
        self,
        nixl_agent_meta: NixlAgentMetadata,
        remote_tp_rank: int = 0,
        remote_tp_size: int = 1,
        remote_dcp_size: int = 1,
    ) -> str:
        """vLLM 0.33.0 ``add_remote_agent``, after our checks, remembering the remote rank.

        Why: upstream registers the remote engine and loads its agent before
        ``_validate_remote_agent_handshake`` (asserts) runs, never compares
        the Mamba state sizes, and refuses neither sliding-window groups nor
        prefix caching of a model without Mamba state across unequal ratios;
        and which bytes of a prefill page this decode rank reads depends on
        the prefill rank when SSM groups are replicated, which upstream does
        not pass to ``_build_mamba_remote``. What changes: first
        ``_refuse_before_loading`` (a ``HandshakeError`` fails the requests
        waiting on this handshake, as any handshake failure does upstream),
        then upstream's method with ``_remote_tp_rank_being_added`` set.
        Remove when: upstream validates before loading and passes the rank.
        """
        if (0, remote_tp_rank) not in self._remote_agents.get(nixl_agent_meta.engine_id, {}):
            self._refuse_before_loading(nixl_agent_meta, remote_tp_rank, remote_tp_size)
        self._remote_tp_rank_being_added = remote_tp_rank
        try:
            return super().add_remote_agent(
                nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size
            )
        finally:
            self._remote_tp_rank_being_added = None

    @functools.cached_property
    def _group_kinds(self) -> tuple[blocks.GroupKind, ...]:
        return group_kinds(self.kv_cache_config.transfer_groups)

    def _refuse_before_loading(
        self, nixl_agent_meta: NixlAgentMetadata, remote_tp_rank: int, remote_tp_size: int
    ) -> None:
        local_layout = (
            self.host_buffer_kv_cache_layout if self.use_host_buffer else self.kv_cache_layout
        )
        # vLLM converts exactly this pair on receive when asked (not under HMA)
        layout_conversion = self.use_mla or (
            bool(self.kv_transfer_config.enable_permute_local_kv)
            and nixl_agent_meta.kv_cache_layout == "LBHNC"
            and local_layout == "LBNHC"
            and not self._is_hma_required
        )
        remote_regions = len(nixl_agent_meta.kv_caches_base_addr)
        local_regions = len(self.block_len_per_layer) if self.pp_size == 1 else remote_regions
        expected_ssm_sizes = None
        remote_ssm_sizes = None
        if self._split is not None:
            expected_ssm_sizes = state_sizes(self._split, remote_tp_size, remote_tp_rank)
            remote_ssm_sizes = tuple(int(size) for size in nixl_agent_meta.ssm_sizes)
        handshake.refuse_before_loading(
            handshake.AgentFacts(
                kv_cache_layout=str(local_layout),
                num_regions=local_regions,
                physical_per_logical=self._physical_blocks_per_logical_kv_block,
                ssm_sizes=expected_ssm_sizes,
            ),
            handshake.AgentFacts(
                kv_cache_layout=str(nixl_agent_meta.kv_cache_layout),
                num_regions=remote_regions,
                physical_per_logical=nixl_agent_meta.physical_blocks_per_logical_kv_block,
                ssm_sizes=remote_ssm_sizes,
            ),
            self._group_kinds,
            local_prefix_caching=bool(self.vllm_config.cache_config.enable_prefix_caching),
            layout_conversion=layout_conversion,
        )

    def _apply_prefix_caching(
        self,
        decode_block_ids: BlockIds,
        prefill_block_ids: BlockIds,
        decode_physical_per_logical: int,
        prefill_physical_per_logical: int,
    ) -> tuple[BlockIds, BlockIds]:
        """vLLM 0.33.0 ``_apply_prefix_caching``, for models without Mamba state
        read across unequal ratios.

        Why: upstream trims prefill's kernel list to decode's length from the
        tail; across unequal ratios the lists differ by rounding surplus at
        the END, so every block pairs with the wrong one. What changes: for a
        model without Mamba state and unequal ratios, leading blocks pair and
        the surplus is dropped (``blocks.align_kernel_ids_by_group``; prefix
        caching and sliding-window groups are refused at handshake in that
        setup); every other case is upstream's. A ``BlockAlignmentError``
        fails the request (``_read_blocks``). Remove when: upstream pairs
        unequal ratios of dense models by position.
        """
        if self._has_mamba or decode_physical_per_logical == prefill_physical_per_logical:
            return super()._apply_prefix_caching(
                decode_block_ids=decode_block_ids,
                prefill_block_ids=prefill_block_ids,
                decode_physical_per_logical=decode_physical_per_logical,
                prefill_physical_per_logical=prefill_physical_per_logical,
            )
        decode_aligned, prefill_aligned = blocks.align_kernel_ids_by_group(
            decode_block_ids,
            prefill_block_ids,
            self._group_kinds,
            local_physical_per_logical=decode_physical_per_logical,
            remote_physical_per_logical=prefill_physical_per_logical,
        )
        return [ids.tolist() for ids in decode_aligned], [ids.tolist() for ids in prefill_aligned]

    def _read_blocks(
        self,
        read_spec: ReadSpec,
        dst_engine_id: str,
        request_id: str,
        remote_request_id: str,
        local_xfer_side_handle: int,
        local_dram_handle: int | None,
        remote_xfer_side_handle: int,
        expected_consumers: int,
        awaiting_kvs: bool,
    ) -> bool:
        """vLLM 0.33.0 ``NixlPullConnectorWorker._read_blocks``, failing closed.

        Why: upstream checks that the block lists pair (its own asserts, and
        ``_apply_prefix_caching``'s) before its ``try``, so lists that do not
        pair raise out of ``start_load_kv`` and take the engine down with
        them. What changes: a ``BlockAlignmentError`` or an assertion raised
        before a transfer was posted fails this request alone, as upstream
        fails a transfer it could not set up (``_handle_failed_transfer``:
        the request is reported in ``failed_recving``); nothing is read for
        it in this call (reads already posted for it from other prefill ranks
        finish first, as upstream lets them). Remove when: upstream's pairing
        checks fail the request.
        """
        try:
            return super()._read_blocks(
                read_spec,
                dst_engine_id,
                request_id,
                remote_request_id,
                local_xfer_side_handle,
                local_dram_handle,
                remote_xfer_side_handle,
                expected_consumers,
                awaiting_kvs,
            )
        except (BlockAlignmentError, AssertionError) as e:
            self._log_failure(
                failure_type="unpairable_block_lists",
                req_id=request_id,
                msg="block lists of decode and prefill cannot be paired; nothing read",
                error=e,
                dst_engine_id=dst_engine_id,
                remote_rank=read_spec.remote_rank,
            )
            self._handle_failed_transfer(request_id, None, self._recv_failures)
            return False

    # ----------------------------------------------------------- prefill lease

    def _send_heartbeats(self, metadata) -> None:
        """vLLM 0.33.0 ``_send_heartbeats``, noting when each was posted.

        Why: a heartbeat extends prefill's lease, and decode's lease check
        must know by when. What changes: before upstream posts the heartbeats
        of engines it holds agents for, the time is noted per remote request.
        Remove when: upstream's decode refuses reads past the lease.
        """
        now = time.perf_counter()
        for engine_id, info in metadata.heartbeat_by_engine.items():
            if self._remote_agents.get(engine_id):
                for remote_request_id in info.req_ids:
                    self._heartbeats_posted[(engine_id, remote_request_id)] = now
        super()._send_heartbeats(metadata)

    def _lease_end(self, meta) -> float | None:
        """Prefill's lease end of a request on this worker's clock, or None."""
        remote = meta.remote
        if remote is None or remote.blocks_expiry_time is None:
            return None
        # upstream state, required at construction (upstream_contract); only a
        # worker built without its constructor (vLLM's own tests) lacks it
        offset = getattr(self, "_engine_clock_offset", {}).get(remote.engine_id)
        if offset is None:  # no handshake yet: checked again once it is done
            return None
        extension = (self._recving_extra.get(remote.request_id) or {}).get(lease.EXTENSION_PARAM)
        return lease.local_deadline(
            remote.blocks_expiry_time,
            offset,
            self._heartbeats_posted.get((remote.engine_id, remote.request_id)),
            extension,
        )

    @functools.cached_property
    def _heartbeats_posted(self) -> dict[tuple[str, str], float]:
        """(remote engine, remote request id) -> when this worker last posted a heartbeat."""
        return {}

    @functools.cached_property
    def _recving_extra(self) -> dict[str, dict]:
        """remote request id -> our kv_transfer_params fields (``start_load_kv``)."""
        return {}

    def start_load_kv(self, metadata):
        """vLLM 0.33.0 ``start_load_kv``, after noting the lease extension
        prefill's glue sent. Upstream's ``ReqMeta`` keeps vLLM's fields only;
        the extension travels as an attribute our connector sets on the
        metadata (``LEASE_EXTENSIONS_ATTR``)."""
        extensions = getattr(metadata, LEASE_EXTENSIONS_ATTR, None)
        if extensions is None and getattr(metadata, "reqs_to_recv", None):
            # Our scheduler side always attaches the attribute (empty when no
            # extension): its absence means metadata from another connector,
            # or a vLLM that no longer carries our attribute to the worker.
            logger.warning_once(
                "NixlHMAConnector: the connector metadata carries no %s (not built by "
                "NixlHMAConnector's scheduler side, or this vLLM drops attributes on its way "
                "to the worker); prefill's lease is taken as not extended",
                LEASE_EXTENSIONS_ATTR,
            )
        for remote_request_id, extension in (extensions or {}).items():
            self._recving_extra[remote_request_id] = {lease.EXTENSION_PARAM: extension}
        super().start_load_kv(metadata)

    def _read_blocks_for_req(self, req_id: str, meta):
        """vLLM 0.33.0 ``_read_blocks_for_req``, unless prefill's lease ended.

        Why: NIXL READ is one-sided; past the lease prefill may have given
        the blocks to another request, and decode would decode on its KV.
        What changes: a request with local blocks whose lease ends within
        ``lease_margin_s`` fails (``failed_recving``; vLLM fails or
        recomputes it) and nothing is read. Remove when: upstream's decode
        refuses reads past the lease.
        """
        deadline = self._lease_end(meta)
        if (
            deadline is not None
            and blocks.has_local_blocks(meta.local_block_ids)
            and lease.expired(deadline, time.perf_counter(), self._lease_margin_s)
        ):
            logger.error(
                "NixlHMAConnector: the prefill lease of request %s ended; its blocks may "
                "hold another request's KV, so they are not read",
                req_id,
            )
            self.xfer_stats.record_kv_expired_req()
            self._handle_failed_transfer(
                req_id, None, self._recv_failures, record_failed_transfer=False
            )
            self._forget_lease_of(meta)
            return
        super()._read_blocks_for_req(req_id, meta)

    def _pop_done_transfers(self, transfers):
        """vLLM 0.33.0 ``_pop_done_transfers``; a read that finished within
        ``lease_margin_s`` of the lease's end counts as failed (its request's
        metadata is still there at this point of ``get_transfer_results``)."""
        done, failed = super()._pop_done_transfers(transfers)
        now = time.perf_counter()
        for request_id in done:
            meta = self._recving_metadata.get(request_id)
            deadline = self._lease_end(meta) if meta is not None else None
            if deadline is not None and lease.expired(deadline, now, self._lease_margin_s):
                logger.error(
                    "NixlHMAConnector: the read of request %s finished after its prefill "
                    "lease ended; its KV is not trusted",
                    request_id,
                )
                failed.add(request_id)
        for request_id in done | failed:
            self._forget_lease_of(self._recving_metadata.get(request_id))
        return done, failed

    def _forget_lease_of(self, meta) -> None:
        if meta is not None and meta.remote is not None:
            self._heartbeats_posted.pop((meta.remote.engine_id, meta.remote.request_id), None)
            self._recving_extra.pop(meta.remote.request_id, None)

    def _build_mamba_remote(
        self,
        nixl_agent_meta: NixlAgentMetadata,
        tp_ratio: int,
        transfer_info: EngineTransferInfo,
    ) -> np.ndarray:
        """vLLM 0.33.0 ``_build_mamba_remote``, with our offsets.

        Why: upstream's ``remote_conv_offsets`` place B and C as if the SSM
        groups were sharded across the larger TP; with fewer groups
        (granite-4.0-h has one, replicated on every rank) decode's B and C
        are read from the wrong bytes at unequal TP. What changes: the same
        N x 5 strided list (per Mamba region: x, B, C, then the SSM state),
        with offsets and sizes from ``mamba_conv.conv_read_plan`` and
        ``ssm_read_plan`` for this decode rank and the prefill rank being
        added; prefill's conv-state size is checked against the model's
        first. Remove when: upstream reads replicated groups right.
        """
        if self._split is None:
            return super()._build_mamba_remote(nixl_agent_meta, tp_ratio, transfer_info)
        if self._ple_region_index is not None:
            raise UnsupportedModelError("per-layer embedding pages beside Mamba state")
        remote_rank = self._remote_tp_rank_being_added
        if remote_rank is None:
            raise RuntimeError("_build_mamba_remote outside add_remote_agent")
        reads = remote_page_reads(
            self._split,
            transfer_info.remote_tp_size,
            remote_rank,
            self.world_size,
            self.tp_rank,
            nixl_agent_meta.ssm_sizes[0],
        )
        remote_physical_per_logical = transfer_info.remote_physical_blocks_per_logical
        num_blocks = nixl_agent_meta.num_blocks // remote_physical_per_logical
        device_id = nixl_agent_meta.device_id
        region_indices = self._ssm_region_indices or range(len(nixl_agent_meta.kv_caches_base_addr))
        strided: list[tuple[int, int, int, int, int]] = []
        for region in region_indices:
            base_addr = nixl_agent_meta.kv_caches_base_addr[region]
            block_stride = nixl_agent_meta.block_strides[region] * remote_physical_per_logical
            strided.extend(
                (base_addr + offset, size, device_id, block_stride, num_blocks)
                for offset, size in reads
            )
        return self._pack_strided_descs(strided)
