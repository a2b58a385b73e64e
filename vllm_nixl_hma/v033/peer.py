"""The 0.33.0 worker's dealings with a prefill rank: the checks before its
agent is loaded, and where decode reads its Mamba state (``PeerChecks``, a
part of ``NixlHMAConnectorWorker``; the ledger in ``worker.py`` says why each
method departs from upstream).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from vllm_nixl_hma._compat import require_adapter

require_adapter("v033", "vllm_nixl_hma.v033.peer")

from vllm.distributed.kv_transfer.kv_connector.utils import (  # noqa: E402
    EngineTransferInfo,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (  # noqa: E402
    NixlAgentMetadata,
)

from vllm_nixl_hma.core import addresses, handshake  # noqa: E402
from vllm_nixl_hma.core.errors import UnsupportedModelError  # noqa: E402
from vllm_nixl_hma.core.remote_rank import RemoteRankBeingAdded  # noqa: E402
from vllm_nixl_hma.core.state_split import (  # noqa: E402
    StateSplit,
    remote_state_reads,
    state_sizes,
)

__all__ = ["PeerChecks"]


class PeerChecks(RemoteRankBeingAdded):
    """Peer checks and Mamba reads of ``NixlHMAConnectorWorker`` (a mixin
    before vLLM's ``NixlPullConnectorWorker`` in its bases)."""

    #: this rank's state split (``worker.__init__``); None: upstream's offsets
    _split: StateSplit | None = None
    #: upstream pairs unequal ratios from the last token for this model, so
    #: the handshake does not refuse them (the 0.34 glue, without Mamba state)
    _upstream_pairs_by_last_token: bool = False

    def _nixl_handshake(self, host: str, port: int, *args, **kwargs):
        """vLLM 0.33.0 ``_nixl_handshake``, after a check of the host it dials.

        Why: prefill advertises its ``VLLM_NIXL_SIDE_CHANNEL_HOST`` and
        upstream dials whatever it is; a wildcard or loopback host makes a
        decode engine on another host dial itself (no answer, or its own
        listener answering for another engine). What changes: such a host is
        refused naming the setting and both values (``addresses``) while
        this engine's own side-channel host is on a network; the refusal
        fails the waiting requests as any handshake failure does upstream.
        Remove when: upstream checks the address it is given.
        """
        from vllm import envs

        engine_id = kwargs.get("expected_engine_id", args[1] if len(args) > 1 else None)
        with self._noting_handshake_failure(engine_id):
            addresses.check_before_dialing(host, envs.VLLM_NIXL_SIDE_CHANNEL_HOST)
            return super()._nixl_handshake(host, port, *args, **kwargs)

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
        then upstream's method inside ``_adding_remote_rank``.
        Remove when: upstream validates before loading and passes the rank.
        """
        if (0, remote_tp_rank) not in self._remote_agents.get(nixl_agent_meta.engine_id, {}):
            self._refuse_before_loading(nixl_agent_meta, remote_tp_rank, remote_tp_size)
        with self._adding_remote_rank(remote_tp_rank):
            return super().add_remote_agent(
                nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size
            )

    def _validate_remote_agent_handshake(
        self,
        nixl_agent_meta: NixlAgentMetadata,
        remote_tp_size: int,
        remote_dcp_size: int = 1,
    ):
        """vLLM 0.33.0 ``_validate_remote_agent_handshake``, without its one
        refusal of prefix caching across unequal ratios when we pair by position.

        Why: upstream raises "Prefix caching with heterogeneous
        physical_blocks_per_logical is not supported for Mamba hybrid models"
        for every prefill rank whose kernel-per-logical ratio differs from
        decode's while prefix caching is on, because its tail rule mispairs a
        decode-side hit there. With token spans (``positions``, read by
        ``ReadPath``) a decode-side hit pairs right at any ratio, and our
        ``_refuse_before_loading`` has already refused every case position
        pairing does not serve (a model without Mamba state, sliding-window
        groups, ``mamba_prefix_caching: false``). What changes: upstream's
        checks run on a copy of prefill's metadata whose
        ``physical_blocks_per_logical_kv_block`` is decode's; that field is
        read by this method alone for that refusal and for a DCP check, so
        the copy is handed only with DCP 1 on both sides. The registered
        metadata, the transfer topology and the config are untouched (other
        handshake threads read them). Remove when: upstream pairs decode-side
        hits by position.
        """
        return super()._validate_remote_agent_handshake(
            self._metadata_for_upstream_checks(nixl_agent_meta, remote_dcp_size),
            remote_tp_size,
            remote_dcp_size,
        )

    def _metadata_for_upstream_checks(
        self, nixl_agent_meta: NixlAgentMetadata, remote_dcp_size: int
    ) -> NixlAgentMetadata:
        """Prefill's metadata, or a copy with decode's kernel-per-logical ratio
        when pairing by position with DCP 1 on both sides (see
        ``_validate_remote_agent_handshake``)."""
        local_ratio = self._physical_blocks_per_logical_kv_block
        if (
            self._pairs_by_position
            and nixl_agent_meta.physical_blocks_per_logical_kv_block != local_ratio
            and self.dcp_size == 1
            and remote_dcp_size == 1
        ):
            return dataclasses.replace(
                nixl_agent_meta, physical_blocks_per_logical_kv_block=local_ratio
            )
        return nixl_agent_meta

    def _remote_region_count(self, nixl_agent_meta: NixlAgentMetadata) -> int:
        """The regions of prefill's metadata, as decode's are counted."""
        return len(nixl_agent_meta.kv_caches_base_addr)

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
        remote_regions = self._remote_region_count(nixl_agent_meta)
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
            pairs_by_position=self._pairs_by_position,
            pairs_by_last_token=self._upstream_pairs_by_last_token,
        )

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
        return self._state_reads(
            nixl_agent_meta,
            transfer_info,
            self._ssm_region_indices or range(len(nixl_agent_meta.kv_caches_base_addr)),
        )

    def _state_reads(
        self,
        nixl_agent_meta: NixlAgentMetadata,
        transfer_info: EngineTransferInfo,
        remote_regions: Sequence[int],
    ) -> np.ndarray:
        """The strided descriptors of our reads of the prefill rank being
        added: its Mamba state in ``remote_regions`` (indices into
        ``nixl_agent_meta``'s region lists), per ``mamba_conv``'s plans."""
        if self._ple_region_index is not None:
            raise UnsupportedModelError("per-layer embedding pages beside Mamba state")
        return self._pack_strided_descs(
            remote_state_reads(
                self._split,
                remote_tp_size=transfer_info.remote_tp_size,
                remote_rank=self._remote_rank_being_added(),
                local_tp_size=self.world_size,
                local_rank=self.tp_rank,
                remote_conv_bytes_reported=nixl_agent_meta.ssm_sizes[0],
                remote_num_kernel_blocks=nixl_agent_meta.num_blocks,
                remote_physical_per_logical=transfer_info.remote_physical_blocks_per_logical,
                region_bases_and_kernel_strides=[
                    (
                        nixl_agent_meta.kv_caches_base_addr[region],
                        nixl_agent_meta.block_strides[region],
                    )
                    for region in remote_regions
                ],
            ).strided(nixl_agent_meta.device_id)
        )
