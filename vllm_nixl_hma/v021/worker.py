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

Reads in flight too long (``_pop_done_transfers``)
    Why: upstream waits for a posted read for ever; a prefill host gone
    without a reset (link or host down) leaves it in flight for as long as
    UCX keeps the connection. How: a read still in flight at the lease
    margin or ``read_timeout_s`` after it was posted fails as a failed
    transfer does, and the engine's agents are released. Remove when:
    upstream bounds a read's time.

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

A progress thread that can pause (``__init__``, opt-in)
    Why: NIXL's Python API builds every agent with a progress thread that
    polls UCX without pause, a core per engine worker even when idle; on a
    small host several engines' threads starved the side channel until a
    first handshake timed out (``progress_thread`` has the numbers). How:
    with ``progress_thread_delay_us`` in ``kv_connector_extra_config``, the
    agent is built with that wait between polls; absent, as NIXL builds it.
    Remove when: NIXL's Python API takes the delay itself.

``start_load_kv(metadata)``, requests refused for their ticket (``ticket_checks``)
    Why: ``kv_transfer_params`` come in the client's request body, and
    upstream dials the host they name and reads the blocks they list. How:
    our scheduler side judges each request's ticket (``tickets``) and hands
    the refused ones over apart from ``reqs_to_recv``; the worker records
    them failed, reports their blocks invalid and reports them done without
    a handshake, agent load or read. Remove when: upstream authenticates its
    params.

``_validate_remote_agent_handshake(nixl_agent_meta, remote_tp_size)``
    Why: upstream accepts a Mamba hybrid peer with another ratio while prefix
    caching is on, and the mismatch surfaces mid-request. How:
    ``blocks.check_alignable`` first, then upstream's checks. Remove when:
    as above.
"""

from __future__ import annotations

import copy
import functools
import os

from vllm_nixl_hma import _compat
from vllm_nixl_hma._compat import require_adapter

require_adapter("v021", "vllm_nixl_hma.v021.worker")

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    worker as upstream_worker_module,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import (  # noqa: E402
    NixlConnectorWorker,
)
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    KVCacheConfig,
)

from vllm_nixl_hma.core import (  # noqa: E402
    addresses,
    blocks,
    lease,
    progress_thread,
    read_threads,
    slow_reads,
    ucx_settings,
    upstream_contract,
)
from vllm_nixl_hma.core.groups import group_kinds_of  # noqa: E402
from vllm_nixl_hma.core.state_split import (  # noqa: E402
    StateSplit,
    derive_state_split,
)

__all__ = [
    "NixlHMAConnectorWorker",
    "NixlHMAHandshakePayload",
    "build_nixl_agent",
    "group_kinds_of",
]


logger = init_logger(f"vllm.{__name__}")


def build_nixl_agent(
    agent_cls, name: str, config, split_batch_size: int, progress_delay_us: int | None = None
):
    """``agent_cls(name, config)`` (NIXL's ``nixl_agent``), with UCX's
    ``split_batch_size`` when ``config`` asks for UCX alone with threads,
    and with ``progress_delay_us`` as its progress thread's wait between
    polls when given (``progress_thread``); any other agent is built exactly
    as asked (see ``read_threads``), and so is one whose class cannot add a
    backend after it is built (``NixlWrapper`` stand-ins, such as vLLM's own
    tests use)."""
    with progress_thread.agents_built_with_delay(agent_cls, progress_delay_us):
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


from vllm_nixl_hma.request_records import RequestRecords021, records_enabled  # noqa: E402
from vllm_nixl_hma.transfer_stats import NixlHMAKVConnectorStats  # noqa: E402
from vllm_nixl_hma.v021.failures import FailedRequests, FailureReports  # noqa: E402
from vllm_nixl_hma.v021.lease_checks import LeaseChecks  # noqa: E402
from vllm_nixl_hma.v021.peer import (  # noqa: E402
    NixlHMAHandshakePayload,
    PeerChecks,
)
from vllm_nixl_hma.v021.read_path import ReadPath  # noqa: E402
from vllm_nixl_hma.v021.ticket_checks import TicketChecks  # noqa: E402


class NixlHMAConnectorWorker(
    RequestRecords021,
    TicketChecks,
    ReadPath,
    PeerChecks,
    FailureReports,
    LeaseChecks,
    NixlConnectorWorker,
):
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
        the ledger), and with ``progress_thread_delay_us`` when that is set
        (``progress_thread``); ``kv_connector_extra_config``
        ``split_batch_size`` and ``progress_thread_delay_us`` are checked
        here, before any agent exists, and so are ``read_timeout_s`` and
        ``UCX_NET_DEVICES`` (``addresses.check_at_start``).
        """
        contract = upstream_contract.V021
        for note in (_compat.untested_nixl(), _compat.untested_patch()):
            if note:
                logger.warning_once("NixlHMAConnector: %s", note)
        contract.require_worker_class(NixlConnectorWorker)
        upstream_contract.require(
            upstream_worker_module,
            contract.worker_module,
            owner_name=upstream_worker_module.__name__,
            release=contract.release,
        )
        extra_config = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None)
        split_batch_size = read_threads.split_batch_size_from(extra_config)
        progress_delay_us = progress_thread.delay_us_from(extra_config)
        lease.configured_read_timeout_s(extra_config)  # a bad read_timeout_s stops startup
        slow_reads.configured_slow_read_s(extra_config)  # and so does a bad slow_read_s
        addresses.check_at_start()  # UCX_NET_DEVICES names devices this host has
        # before the agent's UCX reads its configuration (core/ucx_settings.py)
        logger.info_once(ucx_settings.describe(ucx_settings.apply(os.environ)))

        def split_for_this_rank(mamba_spec, local_tp):
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return derive_state_split(
                vllm_config, mamba_spec, local_tp, get_tensor_model_parallel_rank()
            )

        upstream_agent_cls = upstream_worker_module.NixlWrapper

        def agent_spreading_reads(name, config):
            return build_nixl_agent(
                upstream_agent_cls, name, config, split_batch_size, progress_delay_us
            )

        ours: dict[str, object] = {"derive_mamba_conv_split": split_for_this_rank}
        if upstream_agent_cls is not None:  # None: upstream refuses to start
            ours["NixlWrapper"] = agent_spreading_reads
        with upstream_contract.names_swapped(upstream_worker_module, ours):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        contract.require_state(self, contract.worker_state, NixlConnectorWorker, "its constructor")
        self._failed_recv_reqs = FailedRequests(self._failed_recv_reqs)
        records_enabled(extra_config)  # a bad transfer_records stops startup
        self.xfer_stats = NixlHMAKVConnectorStats()  # upstream's, plus our counts
        self._watch_notifications()  # who read, for prefill's records

    @property
    def _state_split(self) -> StateSplit:
        if not isinstance(self._conv_decomp, StateSplit):
            raise RuntimeError("the worker has no Mamba-type state")
        return self._conv_decomp

    @functools.cached_property
    def _group_kinds(self) -> tuple[blocks.GroupKind, ...]:
        return group_kinds_of(self.kv_cache_config)

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
