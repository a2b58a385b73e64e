"""The 0.33.0 worker's read path: block lists paired by token position after
a decode-side prefix-cache hit, or across unequal kernel-per-logical ratios
of models without Mamba state, and lists that cannot be paired failing their
request alone (``ReadPath``, a part of ``NixlHMAConnectorWorker``; the ledger
in ``worker.py`` says why each method departs from upstream).
"""

from __future__ import annotations

import functools

from vllm_nixl_hma._compat import require_adapter

require_adapter("v033", "vllm_nixl_hma.v033.read_path")

from vllm.distributed.kv_transfer.kv_connector.utils import BlockIds  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import (  # noqa: E402
    ReadSpec,
)

from vllm_nixl_hma.core import blocks, positions  # noqa: E402
from vllm_nixl_hma.core.errors import BlockAlignmentError  # noqa: E402
from vllm_nixl_hma.core.groups import group_windows  # noqa: E402
from vllm_nixl_hma.core.transfer_records import Reason  # noqa: E402

__all__ = ["ReadPath"]


class ReadPath:
    """The read path of ``NixlHMAConnectorWorker`` (a mixin before vLLM's
    ``NixlPullConnectorWorker`` in its bases: ``super()`` is upstream's)."""

    #: the token span of the request ``_read_blocks`` is pairing, for
    #: ``_apply_prefix_caching`` (which upstream calls with lists only)
    _span_being_read: positions.TokenSpan | None = None
    #: the kernel block tokens of the prefill engine ``_read_blocks`` reads from
    _prefill_kernel_tokens_being_read: int = 0
    #: the request ``_read_blocks_for_req`` is pairing lists for, and the prefill
    #: engine ``_read_blocks`` reads from (the 0.34 glue's pairing reads them)
    _request_being_paired: str | None = None
    _engine_being_read: str | None = None

    @functools.cached_property
    def _group_windows(self) -> tuple[int, ...]:
        """The sliding window of each transferred KV cache group in tokens, 0
        without one."""
        return group_windows(self.kv_cache_config.transfer_groups)

    @functools.cached_property
    def _pairs_by_position(self) -> bool:
        """Lists are paired by the token spans decode's scheduler side hands
        over: for a Mamba hybrid with prefix caching, or whenever
        ``mamba_prefix_caching`` is true (``positions.pairs_by_position``)."""
        return positions.worker_pairs_by_position(self)

    @functools.cached_property
    def _token_spans(self) -> dict[str, positions.TokenSpan]:
        """{request id: its span}, from the metadata until its receive ends"""
        return {}

    def start_load_kv(self, metadata):
        """vLLM 0.33.0 ``start_load_kv``, after noting the token span of each
        request to receive (``positions.METADATA_ATTR``, set by
        ``NixlHMAConnector.build_connector_meta``). No upstream counterpart:
        upstream pairs by list lengths.

        A span is kept while upstream keeps the request's receive metadata
        (``_recving_metadata``: until its reads finish or fail). It cannot be
        dropped once ``_read_blocks_for_req`` returns, as on 0.21: on 0.33
        that method also starts the handshake of an unknown prefill engine
        and returns, and the request comes back to it from the handshake
        thread's queue. Every receive keeps its span, whichever way it
        pairs: the span's token count is what prefill's lists must hold
        (``positions.check_prefill_lists``)."""
        positions.hold_spans(
            self._token_spans,
            getattr(metadata, positions.METADATA_ATTR, None),
            receiving=metadata.reqs_to_recv,
            in_flight=self._recving_metadata,
        )
        super().start_load_kv(metadata)

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
        fails the request (``_read_blocks``). With a token span (prefix
        caching of a Mamba hybrid, ``positions``): pairing by token position,
        where upstream pairs a decode-side hit at unequal ratios from token
        0. Before any pairing, prefill's lists must be as long as the lists
        of the prompt's tokens (``positions.check_prefill_lists``: upstream
        pairs a list cut short with a decode that needs as few blocks, an
        every-layer window shorter than a block, and reads the wrong block).
        Remove when: upstream pairs by position and checks prefill's lists
        against ``remote_num_tokens``.
        """
        span = self._span_being_read
        if span is not None:
            positions.check_prefill_lists(
                prefill_block_ids,
                self._group_kinds,
                self._group_windows,
                span,
                remote_kernel_block_tokens=self._prefill_kernel_tokens_being_read,
                remote_physical_per_logical=prefill_physical_per_logical,
            )
        if span is not None and self._pairs_by_position:
            local_aligned, remote_aligned = positions.pair_by_token_position(
                decode_block_ids,
                prefill_block_ids,
                self._group_kinds,
                span,
                kernel_block_tokens=int(self.block_size),  # kernel tokens once registered
                local_physical_per_logical=decode_physical_per_logical,
                remote_physical_per_logical=prefill_physical_per_logical,
            )
            return [ids.tolist() for ids in local_aligned], [ids.tolist() for ids in remote_aligned]
        if self._has_mamba or decode_physical_per_logical == prefill_physical_per_logical:
            return super()._apply_prefix_caching(
                decode_block_ids=decode_block_ids,
                prefill_block_ids=prefill_block_ids,
                decode_physical_per_logical=decode_physical_per_logical,
                prefill_physical_per_logical=prefill_physical_per_logical,
            )
        return blocks.align_kernel_id_lists(
            decode_block_ids,
            prefill_block_ids,
            self._group_kinds,
            local_physical_per_logical=decode_physical_per_logical,
            remote_physical_per_logical=prefill_physical_per_logical,
        )

    def _read_blocks_for_req(self, req_id: str, meta) -> None:
        """vLLM 0.33.0 and 0.34.0 ``_read_blocks_for_req``, failing closed.

        Why: upstream works out which blocks of each prefill rank to read
        before it posts any read, outside any ``try``, and raises when it
        cannot: 0.34.0 pairs lists from their last token with
        ``zip(strict=True)`` and raises ``NotImplementedError`` for region
        layouts it does not serve; our checks of prefill's lists raise
        ``BlockAlignmentError`` there too. Such an error leaves
        ``start_load_kv`` and takes the engine down with every request in
        it. What changes: it fails this request alone, as ``_read_blocks``
        does (reported in ``failed_recving``; vLLM fails or recomputes it).
        Remove when: upstream fails the request.
        """
        self._request_being_paired = req_id
        try:
            super()._read_blocks_for_req(req_id, meta)
        except (BlockAlignmentError, AssertionError, NotImplementedError, ValueError) as e:
            self._fail_unpairable(req_id, meta.remote.engine_id, None, e)
        finally:
            self._request_being_paired = None

    def _fail_unpairable(
        self, request_id: str, engine_id: str, remote_rank: int | None, error: Exception
    ) -> None:
        """Fail a request whose lists cannot be paired, before reading for it."""
        self._log_failure(
            failure_type="unpairable_block_lists",
            req_id=request_id,
            msg="block lists of decode and prefill cannot be paired; nothing read",
            error=error,
            dst_engine_id=engine_id,
            remote_rank=remote_rank,
        )
        self._note_not_read(request_id, Reason.UNPAIRABLE, error)
        self._handle_failed_transfer(request_id, None, self._recv_failures)

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
        self._note_read(read_spec, dst_engine_id, request_id)
        self._span_being_read = span = self._token_spans.get(request_id)
        self._engine_being_read = dst_engine_id
        try:
            if span is not None and self.transfer_topo is not None:
                self._prefill_kernel_tokens_being_read = int(
                    self.transfer_topo.get_engine_info(dst_engine_id).remote_block_size
                )
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
            self._fail_unpairable(request_id, dst_engine_id, read_spec.remote_rank, e)
            return False
        finally:
            self._span_being_read = None
            self._engine_being_read = None
