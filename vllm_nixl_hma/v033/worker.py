"""``NixlHMAConnectorWorker`` for vLLM 0.33: upstream's pull worker with our departures.

Ledger of departures from vLLM 0.33.0's ``NixlPullConnectorWorker`` (each
override's docstring says what upstream does, why we depart, and when to
remove it). The class is composed of one mixin per concern, before
upstream's class in its bases: ``peer.PeerChecks`` (``_nixl_handshake``,
``add_remote_agent``, ``_validate_remote_agent_handshake``,
``_build_mamba_remote``), ``read_path.ReadPath`` (``start_load_kv``,
``_apply_prefix_caching``, ``_read_blocks``), ``lease_checks.LeaseChecks``
(the lease), ``ticket_checks.TicketChecks`` (requests refused for their
ticket); this module keeps the constructor:

* ``__init__``: builds this rank's ``StateSplit`` (``state_split``) beside
  upstream's ``MambaConvSplitInfo`` and refuses to start when the two
  disagree on where the local conv parts lie, since upstream's local
  descriptors come from its own. A state ``mamba_conv`` does not describe
  (Mamba1, MLA with SSM) keeps upstream's offsets, with a warning.
* ``__init__`` with ``progress_thread_delay_us`` in
  ``kv_connector_extra_config`` (opt-in): upstream's NIXL agent is built with
  that wait between its progress thread's polls (``progress_thread``); NIXL's
  Python API builds it polling without pause, a core per engine worker.
* ``_nixl_handshake``: refuses, before dialing, a side-channel host that can
  only name decode's own machine (``0.0.0.0``, loopback) while decode's own
  is on a network (``addresses``); upstream dials it and talks to itself.
* ``add_remote_agent``: refuses a prefill rank decode cannot read before
  anything of it is registered or loaded (``handshake.refuse_before_loading``:
  layout, regions, Mamba state sizes, unequal kernel-per-logical ratios with
  sliding-window groups, or with prefix caching where the worker does not
  pair by position; each error names the field, the
  local and the remote value). Upstream loads the agent first and then
  checks, with asserts, and never compares state sizes or refuses a
  sliding-window group. Also records which prefill rank is being added, which
  upstream does not pass on to ``_build_mamba_remote``.
* ``_apply_prefix_caching``: with a token span (decode's scheduler side
  hands one per request when the worker pairs by position: a Mamba hybrid
  with prefix caching, or ``mamba_prefix_caching`` true), blocks pair by
  token position (``positions``); upstream pairs a decode-side hit across
  unequal ratios from the tail, which mispairs or asserts. Without a span,
  a model without Mamba state read across unequal ratios (engines started
  with different ``--block-size``) pairs leading kernel blocks
  (``blocks.align_kernel_ids_by_group``); upstream pairs the decode list
  with prefill's tail, which shifts every block by the rounding surplus.
  ``start_load_kv`` notes the spans, kept while upstream keeps the receive.
* ``_validate_remote_agent_handshake``: when pairing by position (DCP 1),
  upstream's checks run on a copy of prefill's metadata carrying decode's
  kernel-per-logical ratio; upstream refuses a Mamba hybrid with prefix
  caching across unequal ratios there, after the agent was loaded.
* ``_read_blocks``: block lists that cannot be paired fail that one request
  (reported in ``failed_recving``) instead of raising out of
  ``start_load_kv``: upstream's pairing asserts run before its ``try``.
* ``_read_blocks_for_req``: the same for what upstream raises while it
  works out which blocks to read, before any read is posted (its
  ``NotImplementedError``s and asserts; on 0.34 its last-token pairing and
  our checks before it).
* ``_pop_done_transfers``: a read still in flight at the lease margin or
  ``read_timeout_s`` after it was posted fails as a failed transfer does;
  upstream waits for ever (heartbeats keep extending prefill's lease).
* ``_send_heartbeats``, ``_read_blocks_for_req``, ``_pop_done_transfers``:
  the prefill lease (``lease``). Prefill's glue exports its deadline; decode
  maps it onto its clock with upstream's handshake clock offset, extends it
  from the heartbeats it posted, and fails a request whose read would start,
  or did finish, within ``lease_margin_s`` of it. Upstream reads regardless
  (prefill only logs a late read, after its blocks may have been reused).
* ``start_load_kv``: requests our scheduler side refused for their ticket
  (``tickets``) come apart from ``reqs_to_recv`` and fail with nothing
  dialed, loaded or read; upstream reads whatever the client's
  ``kv_transfer_params`` name.
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
import os

from vllm_nixl_hma import _compat
from vllm_nixl_hma._compat import require_adapter

require_adapter("v033", "vllm_nixl_hma.v033.worker")

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (  # noqa: E402
    NixlPullConnectorWorker,
)
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec  # noqa: E402

from vllm_nixl_hma.core import (  # noqa: E402
    addresses,
    blocks,
    lease,
    progress_thread,
    slow_reads,
    ucx_settings,
    upstream_contract,
)
from vllm_nixl_hma.core.errors import UnsupportedModelError  # noqa: E402
from vllm_nixl_hma.core.groups import group_kinds  # noqa: E402
from vllm_nixl_hma.core.state_split import derive_state_split  # noqa: E402
from vllm_nixl_hma.request_records import RequestRecords033, records_enabled  # noqa: E402
from vllm_nixl_hma.transfer_stats import NixlHMAKVConnectorStats  # noqa: E402
from vllm_nixl_hma.v033.lease_checks import LEASE_EXTENSIONS_ATTR, LeaseChecks  # noqa: E402
from vllm_nixl_hma.v033.peer import PeerChecks  # noqa: E402
from vllm_nixl_hma.v033.read_path import ReadPath  # noqa: E402
from vllm_nixl_hma.v033.ticket_checks import TicketChecks  # noqa: E402

__all__ = ["LEASE_EXTENSIONS_ATTR", "NixlHMAConnectorWorker"]

logger = init_logger(f"vllm.{__name__}")


class NixlHMAConnectorWorker(
    RequestRecords033, TicketChecks, PeerChecks, ReadPath, LeaseChecks, NixlPullConnectorWorker
):
    """vLLM 0.33's ``NixlPullConnectorWorker`` with the departures listed in this module."""

    # What __init__ sets has class defaults in the mixins, for a worker built
    # without it (vLLM's own tests build workers that way): no state split of
    # ours, no rank being added, the default lease margin.

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
        upstream reads replicated SSM groups right. Before upstream's
        constructor, a ``UCX_NET_DEVICES`` naming a device this host lacks
        stops startup (``addresses.check_at_start``), and so does a bad
        ``progress_thread_delay_us``; with a good one, upstream's constructor
        builds its NIXL agent with that delay (``_init_with_progress_delay``).
        """
        contract = upstream_contract.installed()  # 0.33.0, or 0.34.0 under the v034 glue
        for note in (_compat.untested_nixl(), _compat.untested_patch()):
            if note:
                logger.warning_once("NixlHMAConnector: %s", note)
        contract.require_worker_class(NixlPullConnectorWorker)
        addresses.check_at_start()  # UCX_NET_DEVICES names devices this host has
        extra_config = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None)
        progress_delay_us = progress_thread.delay_us_from(extra_config)
        slow_reads.configured_slow_read_s(extra_config)  # a bad slow_read_s stops startup
        # before the agent's UCX reads its configuration (core/ucx_settings.py)
        logger.info_once(ucx_settings.describe(ucx_settings.apply(os.environ)))
        if progress_delay_us is None:
            super().__init__(vllm_config, engine_id, kv_cache_config)
        else:
            self._init_with_progress_delay(
                vllm_config, engine_id, kv_cache_config, progress_delay_us
            )
        contract.require_state(
            self, contract.worker_state, NixlPullConnectorWorker, "its constructor"
        )
        self._lease_margin_s = lease.configured_margin_s(
            self.kv_transfer_config.kv_connector_extra_config
        )
        self._read_timeout_s = lease.configured_read_timeout_s(
            self.kv_transfer_config.kv_connector_extra_config
        )
        records_enabled(extra_config)  # a bad transfer_records stops startup
        self.xfer_stats = NixlHMAKVConnectorStats()  # upstream's, plus our counts
        self._watch_notifications()  # who read, for prefill's records
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

    def _init_with_progress_delay(
        self, vllm_config, engine_id: str, kv_cache_config: KVCacheConfig, delay_us: int
    ) -> None:
        """Upstream's constructor, with its NIXL agent built with a progress
        thread that waits ``delay_us`` between polls (``progress_thread``):
        while it runs, ``NixlWrapper`` in upstream's base worker module builds
        the agent inside ``progress_thread.agents_built_with_delay``."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

        contract = upstream_contract.installed()
        upstream_contract.require(
            base_worker,
            contract.worker_module,
            owner_name=base_worker.__name__,
            release=contract.release,
        )
        upstream_agent_cls = base_worker.NixlWrapper

        def agent_with_delay(name, config):
            with progress_thread.agents_built_with_delay(upstream_agent_cls, delay_us):
                return upstream_agent_cls(name, config)

        ours = {} if upstream_agent_cls is None else {"NixlWrapper": agent_with_delay}
        with upstream_contract.names_swapped(base_worker, ours):  # None: upstream refuses
            super().__init__(vllm_config, engine_id, kv_cache_config)

    @functools.cached_property
    def _group_kinds(self) -> tuple[blocks.GroupKind, ...]:
        """The kind of each KV cache group vLLM transfers (both mixins pair by it)."""
        return group_kinds(self.kv_cache_config.transfer_groups)
