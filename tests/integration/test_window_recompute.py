"""A request whose KV did not arrive never resumes on blocks it does not hold
(issue #41): vLLM 0.21.0's real scheduler, sliding-window shapes.

A model whose every layer is sliding-window runs as one sliding-window KV
cache group: vLLM puts its null block in place of every block before the
window, and decode reads the window only. Under ``recompute`` upstream
resumes a failed request at its first invalid block, the window's first, and
attends over null blocks for the window's start. The requests here go through
the scheduler vLLM's engine core builds (ours, picked by the config hook),
with NixlHMAConnector's scheduler side: the worker side is played by
reporting, as ours does, every local block the connector's metadata hands the
worker as invalid.
"""

from __future__ import annotations

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from tests.integration.test_scheduler_failures import (
    build_scheduler,
    remote_prefill_request,
    report,
)
from vllm_nixl_hma.core.positions import NULL_BLOCK_ID
from vllm_nixl_hma.harness import coordinator, layout
from vllm_nixl_hma.harness.model_shapes import LAYOUTS, window_layout

PROMPT_TOKENS = 300  # test_scheduler_failures' prompt: 19 logical blocks of 16

#: name -> (layout, hma): every-layer windows longer and shorter than a
#: logical block (16 tokens) and longer than the prompt; the interleaved
#: sliding-window layout with and without the hybrid KV cache manager
SHAPES = {
    "every-layer window 40": (window_layout("swa-only", 40), False),
    "every-layer window 8": (window_layout("swa-only", 8), False),
    "every-layer window 1024": (window_layout("swa-only", 1024), False),
    "every-layer window 40, HMA": (window_layout("swa-only", 40), True),
    "interleaved window 40": (LAYOUTS["swa"], False),
    "interleaved window 40, HMA": (LAYOUTS["swa"], True),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shape(request, tmp_path_factory):
    config, hma = SHAPES[request.param]
    model_dir = coordinator.model_dir_for(config, tmp_path_factory.mktemp("m"))
    vllm_config = layout.build_vllm_config(
        model_dir, 1, "NixlHMAConnector", "decode-engine", "kv_consumer", 256, 512, hma=hma
    )
    with layout.single_process_tp_group(vllm_config):
        kv_cache_config = layout.build_engine_layout(vllm_config, 0).kv_cache_config
    return request.param, vllm_config, kv_cache_config


def fail_the_load(scheduler):
    """Schedule a remote-prefill request (it waits for its KV), report it
    received with every block the worker was told to fill invalid, as our
    worker does when a read fails; return the request, the blocks it held
    and the next schedule's output."""
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-engine",
        "remote_request_id": "prefill-req-1",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "tp_size": 1,
    }
    groups = len(scheduler.kv_cache_config.kv_cache_groups)
    logical = -(-PROMPT_TOKENS // scheduler.block_size)
    ids = list(range(1, logical + 1))
    params["remote_block_ids"] = ids if groups == 1 else [ids] * groups
    request = remote_prefill_request(params=params)
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    held = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    meta = output.kv_connector_metadata.reqs_to_recv[request.request_id]
    told = {b for group in meta.local_block_ids for b in group} - {NULL_BLOCK_ID}
    assert told
    report(scheduler, output, finished_recving={request.request_id}, invalid_block_ids=told)
    return request, held, scheduler.schedule()


def resumed_at(request, next_output) -> int:
    """The token the request's next forward pass starts at."""
    return PROMPT_TOKENS - next_output.num_scheduled_tokens[request.request_id]


def test_every_shape_runs_as_described(shape):
    name, vllm_config, kv_cache_config = shape
    kinds = [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]
    if name.startswith("every-layer"):
        assert kinds == ["SlidingWindowSpec"], kinds  # one window group, HMA or not
    elif name.endswith("HMA"):
        assert sorted(kinds) == ["FullAttentionSpec", "SlidingWindowSpec"], kinds
    else:
        assert kinds == ["FullAttentionSpec"], kinds  # the window folded into full attention


def test_recompute_resumes_only_where_every_block_read_is_held(shape):
    """Under ``recompute`` the request computes again from a token whose
    attention reads only blocks it holds: here, where nothing was cached
    locally, from token 0."""
    name, vllm_config, kv_cache_config = shape
    scheduler = build_scheduler(vllm_config, kv_cache_config, "recompute")
    request, held, next_output = fail_the_load(scheduler)
    assert not request.is_finished()
    assert resumed_at(request, next_output) == 0, (name, held)
    # nothing of the failed load stays cached for a later request to hit
    assert scheduler.kv_cache_manager.get_computed_blocks(request)[1] == 0


def test_fail_finishes_the_request_with_an_error(shape):
    name, vllm_config, kv_cache_config = shape
    scheduler = build_scheduler(vllm_config, kv_cache_config, "fail")
    request, _, next_output = fail_the_load(scheduler)
    assert request.status == RequestStatus.FINISHED_ERROR
    assert request.request_id not in next_output.num_scheduled_tokens


def test_upstreams_scheduler_resumes_a_window_on_null_blocks(tmp_path):
    """Why ours departs (the check above fails on upstream's scheduler):
    upstream resumes an every-layer-window request at the window's first
    block, with null blocks where the window's start should be."""
    model_dir = coordinator.model_dir_for(window_layout("swa-only", 40), tmp_path)
    vllm_config = layout.build_vllm_config(
        model_dir, 1, "NixlHMAConnector", "decode-engine", "kv_consumer", 256, 512, hma=False
    )
    with layout.single_process_tp_group(vllm_config):
        kv_cache_config = layout.build_engine_layout(vllm_config, 0).kv_cache_config
    scheduler = build_scheduler(vllm_config, kv_cache_config, "recompute", Scheduler)
    request, (held,), next_output = fail_the_load(scheduler)
    start = resumed_at(request, next_output)
    assert start > 0
    window_start_block = (start - 40 + 1) // scheduler.block_size
    assert held[window_start_block] == NULL_BLOCK_ID, held
