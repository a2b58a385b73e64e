"""A hybrid request whose KV did not arrive never decodes on it (issue #4, vLLM #52234).

Runs vLLM 0.21.0's real scheduler machinery on CPU: the scheduler vLLM's
engine core would build from the config (``scheduler_config.get_scheduler_cls``,
which the config hook points at ``vllm_nixl_hma.v021.scheduler.make_scheduler``),
with NixlHMAConnector as its connector and a real HMA KV cache config of a
Bamba-shaped hybrid. A remote-prefill request is scheduled, then the worker
side reports it finished with every block invalid, as our worker does when
a handshake is refused or a transfer fails.
"""

from __future__ import annotations

import copy

import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from vllm_nixl_hma.harness import coordinator, layout
from vllm_nixl_hma.harness.model_shapes import LAYOUTS
from vllm_nixl_hma.v021 import scheduler as our_scheduler

PROMPT_TOKENS = 300


@pytest.fixture(scope="module")
def hybrid_config(tmp_path_factory):
    model_dir = coordinator.model_dir_for(LAYOUTS["hybrid"], tmp_path_factory.mktemp("m"))
    vllm_config = layout.build_vllm_config(
        model_dir, 1, "NixlHMAConnector", "decode-engine", "kv_consumer", 256, 512
    )
    with layout.single_process_tp_group(vllm_config):
        kv_cache_config = layout.build_engine_layout(vllm_config, 0).kv_cache_config
    return vllm_config, kv_cache_config


def build_scheduler(vllm_config, kv_cache_config, policy: str, scheduler_factory=None):
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    vllm_config.kv_transfer_config.kv_load_failure_policy = policy
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks  # as the engine core does
    # and so (vLLM 0.33 gives an every-layer sliding window a larger block than --block-size)
    vllm_config.cache_config.block_size = min(
        g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups
    )
    factory = scheduler_factory or vllm_config.scheduler_config.get_scheduler_cls()
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return factory(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        log_stats=False,
    )


def remote_prefill_request(request_id: str = "req-1", params: dict | None = None) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, PROMPT_TOKENS + 1)),
        sampling_params=SamplingParams(
            # a copy: the connector marks the params it has handled
            max_tokens=4,
            extra_args={"kv_transfer_params": copy.deepcopy(params or REMOTE_PREFILL_PARAMS)},
        ),
        pooling_params=None,
    )


def report(scheduler, output, **kv_connector_output) -> None:
    """What an engine core step with no forward pass hands the scheduler."""
    scheduler.update_from_output(
        output, runner_output([], kv_connector_output=KVConnectorOutput(**kv_connector_output))
    )


def runner_output(req_ids: list[str], **fields) -> ModelRunnerOutput:
    """A ``ModelRunnerOutput`` of ``req_ids``, on each release (vLLM 0.34
    dropped ``req_id_to_index``: the index is the position in ``req_ids``)."""
    import dataclasses

    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        fields["req_id_to_index"] = {req_id: i for i, req_id in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, **fields)


REMOTE_PREFILL_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1], [2, 3, 4, 5]],
    "remote_engine_id": "prefill-engine",
    "remote_request_id": "prefill-req-1",
    "remote_host": "127.0.0.1",
    "remote_port": 1,
    "tp_size": 1,
}


def run_until_failure_reported(scheduler):
    """Schedule the request (it waits for remote KV), then report it received
    with all its blocks invalid; return it and the next schedule's output."""
    request = remote_prefill_request()
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    block_ids = {
        b for group in scheduler.kv_cache_manager.get_block_ids(request.request_id) for b in group
    } - {0}
    assert block_ids
    report(scheduler, output, finished_recving={request.request_id}, invalid_block_ids=block_ids)
    return request, scheduler.schedule()


def test_the_hook_selects_our_scheduler_factory(hybrid_config):
    vllm_config, kv_cache_config = hybrid_config
    assert vllm_config.scheduler_config.scheduler_cls == our_scheduler.FACTORY_PATH
    assert len(kv_cache_config.kv_cache_groups) > 1
    built = build_scheduler(*hybrid_config, "fail")
    expected = (
        our_scheduler.NixlHMAAsyncScheduler
        if vllm_config.scheduler_config.async_scheduling
        else our_scheduler.NixlHMAScheduler
    )
    assert type(built) is expected


def test_policy_fail_finishes_the_request_with_an_error(hybrid_config):
    scheduler = build_scheduler(*hybrid_config, "fail")
    request, next_output = run_until_failure_reported(scheduler)
    assert request.status == RequestStatus.FINISHED_ERROR
    assert request.request_id not in next_output.num_scheduled_tokens


def test_policy_recompute_computes_the_whole_prompt_locally(hybrid_config):
    scheduler = build_scheduler(*hybrid_config, "recompute")
    request, next_output = run_until_failure_reported(scheduler)
    assert not request.is_finished()
    # nothing that was supposed to arrive counts as computed
    assert next_output.num_scheduled_tokens[request.request_id] == PROMPT_TOKENS


def test_stock_scheduler_cannot_take_invalid_blocks_of_a_hybrid(hybrid_config):
    """Why upstream reports no invalid blocks under HMA: its scheduler raises."""
    scheduler = build_scheduler(*hybrid_config, "fail", scheduler_factory=Scheduler)
    with pytest.raises(ValueError, match="unpack"):
        run_until_failure_reported(scheduler)


# ---------------------------------------------------------------------------
# A request decode's serving layer rejected, then finished with an error: vLLM
# submits a pre-aborted copy with the same kv_transfer_params, only so that the
# connector tells prefill to free its blocks (serving.py
# _with_kv_transfer_rejection_cleanup). The worker then sees a request with no
# local block. Found through real engines: with an expired lease our worker
# reported that copy as received, and vLLM's scheduler, which had freed it,
# died on `assert req_id in self.requests` (the decode engine went down).


def decode_worker(vllm_config, worker_cls, mocker):
    """A decode worker with one registered prefill engine and a fake NIXL agent
    (harness/read_path.py), wired to ``vllm_config`` as vLLM would wire it."""
    import queue
    import threading

    from tests.reference import FULL, MAMBA
    from vllm_nixl_hma.harness.read_path import build_read_path_worker

    nixl_wrapper = mocker.Mock()
    nixl_wrapper.get_new_notifs.return_value = {}
    nixl_wrapper.check_xfer_state.return_value = "PROC"  # a read stays in flight
    # the groups and logical blocks of the ``hybrid`` layout's scheduler (a
    # state group, then attention in blocks of 80 tokens: 5 kernel blocks of
    # 16), so that prefill's lists fit the prompt's 299 tokens as decode's
    # read checks them
    worker = build_read_path_worker(
        worker_cls, [MAMBA, FULL], 5, 5, nixl_wrapper, logical_blocks=64
    )
    worker.vllm_config = vllm_config
    worker.kv_transfer_config = vllm_config.kv_transfer_config
    worker.use_host_buffer = False
    worker.enable_permute_local_kv = False
    worker.enable_heterogeneous_attn_post_process = False
    worker._ready_requests = queue.Queue()
    worker._handshake_lock = threading.RLock()
    worker._reqs_to_send = {}
    worker._reqs_to_process = set()
    worker.consumer_notification_counts_by_req = {}
    worker.kv_caches_base_addr = {}
    return worker


def remote_prefill_params(lease_deadline: float) -> dict:
    from vllm_nixl_hma.core import lease
    from vllm_nixl_hma.harness.read_path import REMOTE_ENGINE

    return {
        **REMOTE_PREFILL_PARAMS,
        "remote_engine_id": REMOTE_ENGINE,
        lease.PARAM: lease_deadline,
    }


def one_step(scheduler, worker):
    """schedule -> the worker's start_load_kv and get_finished -> update_from_output,
    as an engine core step with no forward pass; returns the worker's report."""
    output = scheduler.schedule()
    worker.start_load_kv(output.kv_connector_metadata)
    done_sending, done_recving = worker.get_finished()
    invalid = worker.get_block_ids_with_load_errors()
    report(
        scheduler,
        output,
        finished_sending=done_sending or None,
        finished_recving=done_recving or None,
        invalid_block_ids=invalid,
    )
    return done_recving, invalid


@pytest.mark.parametrize("worker_name", ["ours", "stock"])
def test_a_rejected_requests_notify_only_copy_is_never_reported_received(
    hybrid_config, worker_name, mocker
):
    import time

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

    from vllm_nixl_hma import NixlHMAConnectorWorker

    scheduler = build_scheduler(*hybrid_config, "fail")
    worker_cls = NixlHMAConnectorWorker if worker_name == "ours" else NixlConnectorWorker
    worker = decode_worker(hybrid_config[0], worker_cls, mocker)
    params = remote_prefill_params(lease_deadline=time.time() - 60.0)  # ended a minute ago

    # 1. the request: its lease ended, so ours fails it (policy fail)
    request = remote_prefill_request("cmpl-1-0-abcd", params)
    scheduler.add_request(request)
    one_step(scheduler, worker)
    # 2. the serving layer's pre-aborted copy, as EngineCore.add_request handles it
    copy_request = remote_prefill_request("1", params)
    scheduler.add_request(copy_request)
    scheduler.finish_requests([copy_request.request_id], RequestStatus.FINISHED_ABORTED)
    assert copy_request.request_id not in scheduler.requests  # freed at once
    done_recving, _ = one_step(scheduler, worker)  # the copy reaches the worker now

    if worker_name == "stock":
        # stock reads (the lease is ours), so the first request was never failed
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    else:
        assert request.status == RequestStatus.FINISHED_ERROR
    assert copy_request.request_id not in done_recving
    # prefill is still told to free its blocks: upstream's notification
    notified = [c.kwargs.get("notif_msg") for c in worker.nixl_wrapper.send_notif.call_args_list]
    assert notified == [b"prefill-req-1:1"]
    # and the engine goes on: the next request is scheduled normally
    fresh = remote_prefill_request("cmpl-2-0-ef01", remote_prefill_params(time.time() + 480.0))
    scheduler.add_request(fresh)
    one_step(scheduler, worker)
    assert fresh.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_a_notify_only_request_whose_handshake_failed_is_dropped_not_reported(
    hybrid_config, mocker
):
    """Upstream's handshake callback marks every request it waited for as
    failed, the notify-only copy too: ours drops it; upstream reports it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import RemoteMeta, ReqMeta
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

    from vllm_nixl_hma import NixlHMAConnectorWorker
    from vllm_nixl_hma.harness.read_path import REMOTE_ENGINE

    reported = {}
    for name, worker_cls in (("ours", NixlHMAConnectorWorker), ("stock", NixlConnectorWorker)):
        worker = decode_worker(hybrid_config[0], worker_cls, mocker)
        worker._recving_metadata["1"] = ReqMeta(
            local_block_ids=[],
            local_physical_block_ids=[],
            tp_size=1,
            remote=RemoteMeta(
                block_ids=[[1], [2]],
                host="127.0.0.1",
                port=1,
                engine_id=REMOTE_ENGINE,
                request_id="prefill-req-1",
            ),
        )
        worker._failed_recv_reqs.add("1")  # what request_ready does when the handshake fails
        reported[name] = worker.get_finished()[1]
        assert "1" not in worker._recving_metadata or name == "stock"
    assert reported == {"ours": set(), "stock": {"1"}}


def test_a_handshake_failing_while_get_finished_runs_is_reported_by_the_next_call(
    hybrid_config, mocker
):
    """vLLM's handshake thread adds a failed request to ``_failed_recv_reqs``
    whenever its handshake fails, also while the engine's step is inside
    ``get_finished``, between our preparation and upstream's part. Upstream
    then met a request of an engine that never registered: KeyError, the
    decode worker down (seen in CI's fault test). Now the thread waits for
    the step, and the next call reports the request."""
    import threading

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import RemoteMeta, ReqMeta

    from vllm_nixl_hma import NixlHMAConnectorWorker

    worker = decode_worker(hybrid_config[0], NixlHMAConnectorWorker, mocker)
    for request_id, blocks in (("early", [[3], [4]]), ("late", [[5], [6]])):
        worker._recving_metadata[request_id] = ReqMeta(
            local_block_ids=blocks,
            local_physical_block_ids=blocks,
            tp_size=1,
            remote=RemoteMeta(
                block_ids=blocks,
                host="127.0.0.1",
                port=1,
                engine_id="never-registered",
                request_id=f"prefill-{request_id}",
            ),
        )
    worker._failed_recv_reqs.add("early")
    # as upstream's request_ready does: the attribute is looked up when the handshake fails
    handshake_thread = threading.Thread(target=lambda: worker._failed_recv_reqs.add("late"))
    real_report = worker._report_invalid_blocks_of

    def report_then_fail_a_handshake(request_id):
        real_report(request_id)
        if request_id == "early":
            handshake_thread.start()
            handshake_thread.join(timeout=0.2)  # it may not add while the step is inside

    mocker.patch.object(worker, "_report_invalid_blocks_of", report_then_fail_a_handshake)
    assert worker.get_finished()[1] == {"early"}
    handshake_thread.join(timeout=5)
    assert not handshake_thread.is_alive()
    assert worker.get_finished()[1] == {"late"}
    assert worker.get_finished()[1] == set()
