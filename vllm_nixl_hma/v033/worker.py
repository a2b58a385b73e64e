"""``NixlHMAConnectorWorker`` for vLLM 0.33: upstream's pull worker with our departures.

Ledger of departures from vLLM 0.33.0's ``NixlPullConnectorWorker`` (each
override's docstring says what upstream does, why we depart, and when to
remove it):

* ``__init__``: builds this rank's ``StateSplit`` (``state_split``) beside
  upstream's ``MambaConvSplitInfo`` and refuses to start when the two
  disagree on where the local conv parts lie, since upstream's local
  descriptors come from its own.
* ``add_remote_agent``: records which prefill rank is being added, which
  upstream does not pass on to ``_build_mamba_remote``.
* ``_build_mamba_remote``: conv x/B/C and SSM offsets inside the prefill
  rank's page from ``mamba_conv``'s read plans. Upstream derives B and C as
  if SSM groups were always sharded, so a model with fewer groups than the
  larger TP (granite-4.0-h: one group) reads B and C from the wrong bytes at
  prefill TP 2 -> decode TP 1 and 1 -> 2 (measured: ``vllm-nixl-hma check
  --connector NixlConnector --layout hybrid-1group``).

Not redone (0.33 has it): the remote kernel-block expansion, failure
reporting per request, engine cleanup, GatedDeltaNet state splits (read
with our plans as well, which agree with upstream's for q/k/v).
"""

from __future__ import annotations

import numpy as np

from vllm_nixl_hma._compat import require_adapter

require_adapter("v033", "vllm_nixl_hma.v033.worker")

from vllm.distributed.kv_transfer.kv_connector.utils import (  # noqa: E402
    EngineTransferInfo,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (  # noqa: E402
    NixlAgentMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (  # noqa: E402
    NixlPullConnectorWorker,
)
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec  # noqa: E402

from vllm_nixl_hma.errors import UnsupportedModelError  # noqa: E402
from vllm_nixl_hma.state_split import (  # noqa: E402
    StateSplit,
    derive_state_split,
    remote_page_reads,
)

__all__ = ["NixlHMAConnectorWorker"]

logger = init_logger(f"vllm.{__name__}")


class NixlHMAConnectorWorker(NixlPullConnectorWorker):
    """vLLM 0.33's ``NixlPullConnectorWorker`` with the departures listed in this module."""

    def __init__(self, vllm_config, engine_id: str, kv_cache_config: KVCacheConfig):
        """vLLM 0.33.0 ``NixlPullConnectorWorker.__init__``, then our state split.

        Why: ``_build_mamba_remote`` below places remote reads with
        ``mamba_conv``, while upstream's ``_build_mamba_local`` places the
        local descriptors with its own ``MambaConvSplitInfo``; both must name
        the same bytes of the local page. What changes: after upstream's
        constructor, a Mamba hybrid gets ``_state_split`` for this rank, and
        its local conv offsets are compared with upstream's
        (``UnsupportedModelError`` if they differ, before any handshake).
        Remove when: upstream reads replicated SSM groups right.
        """
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._remote_tp_rank_being_added: int | None = None
        self._split: StateSplit | None = None
        if not self._has_mamba:
            return
        mamba_spec = next(
            spec for spec in self._layer_specs.values() if isinstance(spec, MambaSpec)
        )
        split = derive_state_split(vllm_config, mamba_spec, self.world_size, self.tp_rank)
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
        """vLLM 0.33.0 ``add_remote_agent``, remembering the remote rank.

        Why: which bytes of a prefill page this decode rank reads depends on
        the prefill rank when SSM groups are replicated, and upstream does not
        pass the rank to ``_build_mamba_remote``. What changes: nothing but
        ``_remote_tp_rank_being_added`` while upstream's method runs. Remove
        when: upstream passes the rank.
        """
        self._remote_tp_rank_being_added = remote_tp_rank
        try:
            return super().add_remote_agent(
                nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size
            )
        finally:
            self._remote_tp_rank_being_added = None

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
