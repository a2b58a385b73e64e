"""``NixlHMAConnectorWorker`` for vLLM 0.34: the 0.33 glue's worker, where
vLLM 0.34.0 changed what it overrides.

Ledger of what differs from the 0.33 glue (``vllm_nixl_hma.v033.worker``,
whose ledger lists every departure from upstream; each is kept here unless
named below). The work list came from ``vllm-nixl-hma drift`` on vLLM
0.34.0's wheel against the 0.33 glue (``docs/porting.md``):

* ``_validate_remote_agent_handshake``: upstream added ``local_region_ids``
  (the local region each remote region pairs with); our departure (a copy
  of prefill's metadata with decode's ratio when pairing by position) is
  the 0.33 glue's, passing the new argument on.
* ``_build_mamba_remote``: upstream added ``pairs`` (regions are now
  paired by the layers both sides hold, ``_RegionPairs``) and reads the
  remote's SSM regions from ``pairs.remote_ssm_regions``; ours reads the
  same regions, with our offsets (replicated SSM groups are still read
  from the wrong bytes upstream: vLLM #55208).
* ``_remote_region_count`` (ours, read by the handshake checks before
  loading): a prefill's packed row counts as its layers where 0.34.0
  splits it into one region per layer (a BLNHC prefill read by an LBNHC
  decode, which 0.34.0 serves).
* ``_pair_blocks_by_last_token`` (new upstream): with unequal kernel block
  sizes or kernel-per-logical ratios, 0.34.0 pairs block lists itself,
  in ``_read_blocks_for_req``, from the last token of
  ``remote_num_tokens`` (a field of the client's ``kv_transfer_params``),
  before ``_apply_prefix_caching``. That rule reads the same blocks as
  our token-position pairing after a decode-side hit (both lists end at
  the prompt's last token), so on 0.34 it is the one rule: ours only
  checks, before it, that ``remote_num_tokens`` is the count decode's own
  scheduler derived (its ``TokenSpan``) and that prefill's lists are as
  long as that prompt needs (``positions.check_prefill_lists``; upstream
  pairs a list cut short from its end).
* ``_apply_prefix_caching``: lists upstream already paired by last token
  go to upstream's method (equal lengths: it trims nothing); lists of
  equal block sizes keep the 0.33 glue's (the check, then position
  pairing or upstream's tail rule).

Dropped for 0.34 (0.34.0 does it): the leading-block pairing of models
without Mamba state across unequal ratios (``blocks.align_kernel_id_lists``
in the 0.33 glue's ``_apply_prefix_caching``; upstream's last-token rule
pairs those lists right), with the handshake's refusal of such models'
sliding windows and prefix caching across unequal ratios (the rule pairs
them too; ``_upstream_pairs_by_last_token``), and position pairing across
unequal ratios (Mamba hybrids keep the refusal of sliding-window groups and
of ``mamba_prefix_caching: false`` there: upstream still refuses the latter
after loading).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_nixl_hma._compat import require_adapter

require_adapter("v034", "vllm_nixl_hma.v034.worker")

import numpy as np  # noqa: E402
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

from vllm_nixl_hma.core import positions  # noqa: E402
from vllm_nixl_hma.core.errors import BlockAlignmentError  # noqa: E402
from vllm_nixl_hma.v033 import worker as worker033  # noqa: E402
from vllm_nixl_hma.v033.peer import PeerChecks  # noqa: E402

__all__ = ["NixlHMAConnectorWorker"]


class NixlHMAConnectorWorker(worker033.NixlHMAConnectorWorker):
    """vLLM 0.34's ``NixlPullConnectorWorker`` with our departures (this
    module's ledger, and the 0.33 glue's)."""

    @property
    def _upstream_pairs_by_last_token(self) -> bool:
        """For a model without Mamba state, 0.34.0 pairs unequal ratios from
        the prompt's last token, with sliding windows and prefix-cache hits
        alike; the 0.33 glue's handshake refusal of those (its leading-block
        rule could not) would take away what upstream serves right
        (``tests/v033/test_block_sizes_v033.py``)."""
        return not self._has_mamba

    def _remote_region_count(self, nixl_agent_meta: NixlAgentMetadata) -> int:
        """Prefill's regions as 0.34.0 pairs them: a packed row (a
        block-outermost layout, every layer's page in one region) counts as
        its layers when this worker registers layers apart, since upstream
        splits it so (``_expand_remote_packed_rows``) before pairing regions
        by layer name. The 0.33 glue counted the row as one region and
        refused a prefill on BLNHC read by a decode on LBNHC."""
        packed = nixl_agent_meta.packed_member_layouts
        if not packed or self._packed_member_layouts:
            return len(nixl_agent_meta.kv_caches_base_addr)
        return sum(
            len(names) if any(name in packed for name in names) else 1
            for names in nixl_agent_meta.region_members
        )

    def _validate_remote_agent_handshake(
        self,
        nixl_agent_meta: NixlAgentMetadata,
        remote_tp_size: int,
        remote_dcp_size: int = 1,
        local_region_ids: Sequence[int] | None = None,
    ):
        """vLLM 0.34.0 ``_validate_remote_agent_handshake``, as the 0.33 glue's
        (``PeerChecks``: without upstream's refusal of a Mamba hybrid with
        prefix caching across unequal ratios, when we pair by position),
        passing upstream's new ``local_region_ids`` on. Remove when: upstream
        pairs decode-side hits across unequal ratios and drops that refusal.
        """
        return super(PeerChecks, self)._validate_remote_agent_handshake(
            self._metadata_for_upstream_checks(nixl_agent_meta, remote_dcp_size),
            remote_tp_size,
            remote_dcp_size,
            local_region_ids,
        )

    def _build_mamba_remote(
        self,
        nixl_agent_meta: NixlAgentMetadata,
        tp_ratio: int,
        transfer_info: EngineTransferInfo,
        pairs,
    ) -> np.ndarray:
        """vLLM 0.34.0 ``_build_mamba_remote``, with our offsets (as the 0.33
        glue's, ``PeerChecks``), reading prefill's SSM regions where upstream
        paired them (``pairs.remote_ssm_regions``: by layer name, in the
        order of the local SSM regions). Remove when: upstream reads
        replicated SSM groups right (vLLM #55208).
        """
        if self._split is None:
            return super(PeerChecks, self)._build_mamba_remote(
                nixl_agent_meta, tp_ratio, transfer_info, pairs
            )
        return self._state_reads(nixl_agent_meta, transfer_info, pairs.remote_ssm_regions)

    def _pair_blocks_by_last_token(
        self,
        local_block_ids: BlockIds,
        remote_block_ids: BlockIds,
        num_tokens: int,
        block_size_ratio: int,
        remote_physical_per_logical: int,
    ) -> tuple[BlockIds, BlockIds, list[range]]:
        """vLLM 0.34.0 ``_pair_blocks_by_last_token``, after our checks of
        what prefill sent.

        Why: upstream pairs decode's and prefill's lists from the last of
        ``num_tokens`` tokens, a number the client's ``kv_transfer_params``
        carry (``remote_num_tokens``), and a prefill list cut short pairs
        from its end with blocks it does not hold. What changes: with the
        request's ``TokenSpan`` (from decode's own scheduler), a
        ``num_tokens`` other than the span's count, or a prefill list other
        than that many tokens need (``positions.check_prefill_lists``),
        raises ``BlockAlignmentError``, which fails the request before any
        read (``ReadPath._read_blocks_for_req``); then upstream's pairing.
        Remove when: upstream checks prefill's lists against its own count.
        """
        span = self._token_spans.get(self._request_being_paired or "")
        if span is not None:
            if num_tokens != span.prefill_tokens:
                raise BlockAlignmentError(
                    "remote_num_tokens",
                    span.prefill_tokens,
                    num_tokens,
                    "prefill claims another number of this prompt's tokens than decode's "
                    "scheduler counted",
                )
            positions.check_prefill_lists(
                remote_block_ids,
                self._group_kinds,
                self._group_windows,
                span,
                remote_kernel_block_tokens=int(self.block_size) // int(block_size_ratio),
                remote_physical_per_logical=remote_physical_per_logical,
            )
        return super()._pair_blocks_by_last_token(
            local_block_ids,
            remote_block_ids,
            num_tokens,
            block_size_ratio,
            remote_physical_per_logical,
        )

    def _apply_prefix_caching(
        self,
        decode_block_ids: BlockIds,
        prefill_block_ids: BlockIds,
        decode_physical_per_logical: int,
        prefill_physical_per_logical: int,
    ) -> tuple[BlockIds, BlockIds]:
        """vLLM 0.34.0 ``_apply_prefix_caching`` for lists upstream already
        paired by last token, the 0.33 glue's otherwise.

        Why: 0.34.0 calls this after ``_pair_blocks_by_last_token`` when the
        two sides' kernel block sizes or ratios differ; the lists are then
        paired (and checked, above), and the 0.33 glue's checks and pairing
        would take them for prefill's whole lists. What changes: for such a
        read, upstream's method, which leaves equal lists as they are.
        Remove when: with the 0.33 glue's override.
        """
        if self._read_pairs_by_last_token(decode_physical_per_logical):
            return NixlPullConnectorWorker._apply_prefix_caching(
                self,
                decode_block_ids,
                prefill_block_ids,
                decode_physical_per_logical,
                prefill_physical_per_logical,
            )
        return super()._apply_prefix_caching(
            decode_block_ids,
            prefill_block_ids,
            decode_physical_per_logical,
            prefill_physical_per_logical,
        )

    def _read_pairs_by_last_token(self, decode_physical_per_logical: int) -> bool:
        """Whether upstream paired the lists of the read ``_read_blocks`` is
        setting up by last token: 0.34.0's condition in
        ``_read_blocks_for_req`` (different kernel block sizes or ratios;
        ``_apply_prefix_caching`` is not called under DCP)."""
        engine_id = self._engine_being_read
        if engine_id is None or self.transfer_topo is None:
            return False
        remote = self.transfer_topo.get_engine_info(engine_id)
        return (
            self.block_size != remote.remote_block_size
            or remote.remote_physical_blocks_per_logical != decode_physical_per_logical
        )
