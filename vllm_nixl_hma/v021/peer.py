"""The 0.21.0 worker's dealings with a prefill peer: our handshake record
published and checked field by field before the remote agent is loaded,
the side-channel query, the remote agent's descriptors and Mamba reads
(``PeerChecks``, a part of ``NixlHMAConnectorWorker``; the ledger in
``worker.py`` says why each method departs from upstream).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from vllm_nixl_hma._compat import require_adapter

require_adapter("v021", "vllm_nixl_hma.v021.peer")

from vllm.distributed.kv_transfer.kv_connector.utils import (  # noqa: E402
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
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import (  # noqa: E402
    NixlConnectorWorker,
)
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    MambaSpec,
)

from vllm_nixl_hma import __version__  # noqa: E402
from vllm_nixl_hma.core import (  # noqa: E402
    addresses,
    blocks,
    handshake,
    side_channel,
    transfer_records,
    upstream_contract,
)
from vllm_nixl_hma.core.remote_rank import RemoteRankBeingAdded  # noqa: E402
from vllm_nixl_hma.core.state_split import remote_state_reads  # noqa: E402

__all__ = ["NixlHMAHandshakePayload", "PeerChecks", "SIDE_CHANNEL_TIMEOUT_S"]

logger = init_logger(f"vllm.{__name__}")


#: How long decode waits for each side-channel answer by default (as upstream:
#: 5 s); ``kv_connector_extra_config`` ``side_channel_timeout_s`` changes it.
SIDE_CHANNEL_TIMEOUT_S = 5.0


@dataclass
class NixlHMAHandshakePayload(NixlHandshakePayload):
    """vLLM's payload plus our record. A subclass, so that vLLM's scheduler
    serves it unchanged; stock decoders ignore the extra field."""

    vllm_nixl_hma: bytes = b""


class PeerChecks(RemoteRankBeingAdded):
    """Handshake and peer validation of ``NixlHMAConnectorWorker`` (a mixin
    before vLLM's ``NixlConnectorWorker`` in its bases)."""

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
            pairs_by_position=self._pairs_by_position,
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
        with self._adding_remote_rank(remote_tp_rank):
            remote_agent_name = super().add_remote_agent(
                nixl_agent_meta, remote_tp_rank, remote_tp_size
            )
            self._prepare_page_runs(
                nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_agent_name
            )
            return remote_agent_name

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
        return remote_state_reads(
            self._state_split,
            remote_tp_size=transfer_info.remote_tp_size,
            remote_rank=self._remote_rank_being_added(),
            local_tp_size=self.world_size,
            local_rank=self.tp_rank,
            remote_conv_bytes_reported=nixl_agent_meta.ssm_sizes[0],
            remote_num_kernel_blocks=nixl_agent_meta.num_blocks,
            remote_physical_per_logical=transfer_info.remote_physical_blocks_per_logical,
            # every registered region holds Mamba state in upstream's list here
            region_bases_and_kernel_strides=list(
                zip(nixl_agent_meta.kv_caches_base_addr, nixl_agent_meta.block_lens, strict=True)
            ),
        ).per_block(nixl_agent_meta.device_id)

    def register_kv_caches(self, kv_caches):
        """vLLM 0.21.0 ``NixlConnectorWorker.register_kv_caches``, then our record.

        Why: decode needs prefill's layout as prefill states it. What changes:
        after upstream registers the caches and builds its payload, the payload
        is re-wrapped as ``NixlHMAHandshakePayload`` carrying this worker's
        ``HandshakeRecord``. Remove when: upstream carries an equivalent.
        """
        super().register_kv_caches(kv_caches)
        contract = upstream_contract.V021
        contract.require_state(
            self, contract.worker_registered_state, NixlConnectorWorker, "register_kv_caches"
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
            model=str(self.vllm_config.model_config.model),
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
        Before dialing, a side-channel host that can only name this machine
        while this engine is on a network is refused (``addresses``).
        Remove when: upstream validates remote layouts itself.
        """
        import msgspec
        import zmq
        from vllm import envs
        from vllm.utils.network_utils import make_zmq_path

        with self._noting_handshake_failure(expected_engine_id):
            addresses.check_before_dialing(host, envs.VLLM_NIXL_SIDE_CHANNEL_HOST)
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
                    raise handshake.NoAnswerError(
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
            raise handshake.CompatibilityHashMismatch(
                self.compat_hash,
                parsed.compatibility_hash,
                self._handshake_record.model,
                parsed.record.model if parsed.record is not None else "",
            )
        if parsed.record is not None:
            handshake.validate_remote(
                self._handshake_record, parsed.record, self._pairs_by_position
            )
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
            try:
                record = handshake.record_for_stock_peer(
                    self._handshake_record,
                    remote_tp_size=remote_tp_size,
                    block_size=agent_meta.block_size,
                    physical_blocks_per_logical=agent_meta.physical_blocks_per_logical_kv_block,
                    kv_cache_layout=agent_meta.kv_cache_layout,
                )
                handshake.validate_remote(self._handshake_record, record, self._pairs_by_position)
            except handshake.HandshakeError as e:  # its records say stock_peer
                setattr(e, transfer_records.REASON_ATTR, transfer_records.Reason.STOCK_PEER)
                raise
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
