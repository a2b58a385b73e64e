"""The 0.21.0 worker's read path: remote block ids expanded with the remote
ratio, local and remote lists paired per group, page-run descriptors, and
the read posted to NIXL (``ReadPath``, a part of ``NixlHMAConnectorWorker``;
the ledger in ``worker.py`` says why each method departs from upstream).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from vllm_nixl_hma._compat import require_adapter

require_adapter("v021", "vllm_nixl_hma.v021.read_path")

from vllm.distributed.kv_transfer.kv_connector.utils import (  # noqa: E402
    BlockIds,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (  # noqa: E402
    NixlAgentMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import (  # noqa: E402
    ReadSpec,
)
from vllm.logger import init_logger  # noqa: E402

from vllm_nixl_hma.core import (  # noqa: E402
    blocks,
    page_runs,
    positions,
)
from vllm_nixl_hma.core.errors import (  # noqa: E402
    BlockAlignmentError,
)
from vllm_nixl_hma.core.groups import group_windows  # noqa: E402
from vllm_nixl_hma.core.transfer_records import Reason  # noqa: E402

__all__ = ["PageRunList", "ReadPath"]

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


def _same_lengths(local_ids_by_group, remote_ids_by_group) -> bool:
    return len(local_ids_by_group) == len(remote_ids_by_group) and all(
        len(local) == len(remote)
        for local, remote in zip(local_ids_by_group, remote_ids_by_group, strict=True)
    )


class ReadPath:
    """The read path of ``NixlHMAConnectorWorker`` (a mixin before vLLM's
    ``NixlConnectorWorker`` in its bases: ``super()`` is upstream's)."""

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
        return blocks.align_kernel_id_lists(
            local_block_ids,
            remote_block_ids,
            self._group_kinds,
            local_physical_per_logical=self._physical_blocks_per_logical_kv_block,
            remote_physical_per_logical=remote_physical_per_logical,
        )

    # ------------------------------------------- pairing by token position

    @functools.cached_property
    def _pairs_by_position(self) -> bool:
        """Lists are paired by the token spans decode's scheduler side hands
        over: for a Mamba hybrid with prefix caching (kept by the config
        hook), or whenever ``mamba_prefix_caching`` is true."""
        return positions.worker_pairs_by_position(self)

    @functools.cached_property
    def _token_spans(self) -> dict[str, positions.TokenSpan]:
        """{request id: its span}, from the metadata until its reads are posted"""
        return {}

    def start_load_kv(self, metadata):
        """vLLM 0.21.0 ``NixlConnectorWorker.start_load_kv``, after noting the
        token span of each request to receive (``positions.METADATA_ATTR``,
        set by ``NixlHMAConnector.build_connector_meta``). No upstream
        counterpart: upstream pairs by list lengths.

        Every receive keeps its span, whichever way it pairs: the span's
        token count is what prefill's lists must hold
        (``positions.check_prefill_lists``). A span is dropped once its reads
        are posted (``_read_blocks_for_req``), or here once upstream forgot
        the request (``_recving_metadata``: a handshake that failed)."""
        positions.hold_spans(
            self._token_spans,
            getattr(metadata, positions.METADATA_ATTR, None),
            receiving=metadata.reqs_to_recv,
            in_flight=self._recving_metadata,
        )
        super().start_load_kv(metadata)

    @functools.cached_property
    def _group_windows(self) -> tuple[int, ...]:
        """The sliding window of each KV cache group in tokens, 0 without one."""
        return group_windows(self.kv_cache_config.kv_cache_groups)

    def _read_blocks_for_req(self, req_id: str, meta):
        """vLLM 0.21.0 ``NixlConnectorWorker._read_blocks_for_req``; the
        request's token span is dropped once its reads are posted (or
        refused), so the map holds requests waiting for a handshake only."""
        try:
            super()._read_blocks_for_req(req_id, meta)
        finally:
            self._token_spans.pop(req_id, None)

    def _pair_by_position(
        self, read_spec: ReadSpec, span: positions.TokenSpan, remote_physical_per_logical: int
    ) -> tuple[BlockIds, BlockIds]:
        local_aligned, remote_aligned = positions.pair_by_token_position(
            read_spec.local_block_ids,
            read_spec.remote_block_ids,
            self._group_kinds,
            span,
            kernel_block_tokens=int(self.block_size),  # kernel tokens once registered
            local_physical_per_logical=self._physical_blocks_per_logical_kv_block,
            remote_physical_per_logical=remote_physical_per_logical,
        )
        return [ids.tolist() for ids in local_aligned], [ids.tolist() for ids in remote_aligned]

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
        then keeps everything). Prefill's lists must first be as long as the
        lists of the prompt's tokens (``positions.check_prefill_lists``: a
        list cut short pairs by counts with a decode that needs as few
        blocks). Lists that cannot be aligned fail the request before anything is
        read, as upstream does with a failed transfer setup. Remove when:
        vLLM >= 0.22.0 is the minimum.
        """
        if request_id in self._failed_recv_reqs:
            return  # refused on another remote rank already: nothing more is read
        self._note_read(read_spec, dst_engine_id, request_id)
        span = self._token_spans.get(request_id)
        if not blocks.has_local_blocks(read_spec.local_block_ids):
            # nothing to read, only prefill to notify: upstream recognizes that
            # by an empty list (start_load_kv gave such a request empty groups)
            read_spec = ReadSpec(
                remote_rank=read_spec.remote_rank,
                local_block_ids=[],
                remote_block_ids=read_spec.remote_block_ids,
            )
        else:
            if self.transfer_topo is None:
                raise RuntimeError("_read_blocks called before register_kv_caches")
            remote_info = self.transfer_topo.get_engine_info(dst_engine_id)
            remote_ratio = remote_info.remote_physical_blocks_per_logical
            try:
                if span is not None:
                    positions.check_prefill_lists(
                        read_spec.remote_block_ids,
                        self._group_kinds,
                        self._group_windows,
                        span,
                        remote_kernel_block_tokens=int(remote_info.remote_block_size),
                        remote_physical_per_logical=remote_ratio,
                    )
                if span is not None and self._pairs_by_position:
                    local_kernel_ids_by_group, remote_kernel_ids_by_group = self._pair_by_position(
                        read_spec, span, remote_ratio
                    )
                elif not _same_lengths(read_spec.local_block_ids, read_spec.remote_block_ids):
                    local_kernel_ids_by_group, remote_kernel_ids_by_group = (
                        self._apply_prefix_caching(
                            read_spec.local_block_ids, read_spec.remote_block_ids, remote_ratio
                        )
                    )
                else:
                    # equal lengths in every group pair index by index under
                    # every count rule, so the common case skips the conversions
                    local_kernel_ids_by_group = read_spec.local_block_ids
                    remote_kernel_ids_by_group = read_spec.remote_block_ids
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
            self._note_not_read(request_id, Reason.TRANSFER, e)
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
        self._note_not_read(request_id, Reason.UNPAIRABLE, error)
        self._failed_recv_reqs.add(request_id)
