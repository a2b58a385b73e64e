"""A hybrid request whose KV did not arrive never decodes on it (issue #4, vLLM #52234).

Runs vLLM 0.21.0's real scheduler machinery on CPU: the scheduler vLLM's
engine core would build from the config (``scheduler_config.get_scheduler_cls``,
which the config hook points at ``vllm_nixl_hma.scheduler.make_scheduler``),
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

from vllm_nixl_hma import scheduler as our_scheduler
from vllm_nixl_hma.harness import coordinator, layout
from vllm_nixl_hma.harness.model_shapes import LAYOUTS

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


def remote_prefill_request() -> Request:
    return Request(
        request_id="req-1",
        prompt_token_ids=list(range(1, PROMPT_TOKENS + 1)),
        sampling_params=SamplingParams(
            # a copy: the connector marks the params it has handled
            max_tokens=4,
            extra_args={"kv_transfer_params": copy.deepcopy(REMOTE_PREFILL_PARAMS)},
        ),
        pooling_params=None,
    )


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
    scheduler.update_from_output(
        output,
        ModelRunnerOutput(
            req_ids=[],
            req_id_to_index={},
            kv_connector_output=KVConnectorOutput(
                finished_recving={request.request_id}, invalid_block_ids=block_ids
            ),
        ),
    )
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
