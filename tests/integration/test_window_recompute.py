"""A request whose KV did not arrive never resumes on blocks it does not hold
(issue #41): vLLM's real scheduler, sliding-window shapes, on both releases
(the vLLM 0.33 part of tools/test.sh runs this file too).

A model whose every layer is sliding-window runs as one sliding-window KV
cache group: vLLM puts its null block in place of every block before the
window, and decode reads the window only. Under ``recompute`` upstream
resumes a failed request at its first invalid block, the window's first, and
attends over null blocks for the window's start. The requests here go through
the scheduler vLLM's engine core builds (ours, picked by the config hook),
with NixlHMAConnector's scheduler side: the worker side is played by
reporting what ours reports for a failed read: on 0.21.0 every local block the
connector's metadata hands the worker, invalid; on 0.33 the request in
``failed_recving`` (and, with one group, those blocks invalid as well, as
upstream's worker adds them).
"""

from __future__ import annotations

import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from tests.integration.test_decode_hit_scheduler import block_hasher
from tests.integration.test_scheduler_failures import (
    build_scheduler,
    remote_prefill_request,
    report,
    runner_output,
)
from vllm_nixl_hma import _compat
from vllm_nixl_hma.core.positions import NULL_BLOCK_ID
from vllm_nixl_hma.harness import coordinator, layout
from vllm_nixl_hma.harness.model_shapes import installed_layouts, window_layout

PROMPT_TOKENS = 300  # test_scheduler_failures' prompt: 19 logical blocks of 16

#: name -> (layout, hma): every-layer windows longer and shorter than a
#: logical block (16 tokens) and longer than the prompt; the interleaved
#: sliding-window layout with and without the hybrid KV cache manager
SHAPES = {
    "every-layer window 40": (window_layout("swa-only", 40), False),
    "every-layer window 8": (window_layout("swa-only", 8), False),
    "every-layer window 1024": (window_layout("swa-only", 1024), False),
    "every-layer window 40, HMA": (window_layout("swa-only", 40), True),
    "interleaved window 40": (installed_layouts()["swa"], False),
    "interleaved window 40, HMA": (installed_layouts()["swa"], True),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shape(request, tmp_path_factory):
    config, hma = SHAPES[request.param]
    return request.param, *engine_config(config, hma, tmp_path_factory.mktemp("m"))


def engine_config(config, hma, tmp_path, **options):
    model_dir = coordinator.model_dir_for(config, tmp_path)
    vllm_config = layout.build_vllm_config(
        model_dir, 1, "NixlHMAConnector", "decode-engine", "kv_consumer", 256, 512, hma=hma,
        **options,
    )  # fmt: skip
    with layout.single_process_tp_group(vllm_config):
        kv_cache_config = layout.build_engine_layout(vllm_config, 0).kv_cache_config
    return vllm_config, kv_cache_config


def fail_the_load(scheduler, request=None, invalid_only=False):
    """Schedule a remote-prefill request (it waits for its KV), report its
    read failed as our worker does (the module docstring; ``invalid_only``:
    the blocks alone, as 0.21.0 reports); return the request, the blocks it
    held and the next schedule's output."""
    request = request or remote_prefill_request(params=remote_params(scheduler))
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    held = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    meta = output.kv_connector_metadata.reqs_to_recv[request.request_id]
    told = {b for group in meta.local_block_ids for b in group} - {NULL_BLOCK_ID}
    assert told
    failed = {}
    if _compat.builds_on("v033") and not invalid_only:
        failed["failed_recving"] = {request.request_id}
        one_group = len(scheduler.kv_cache_config.kv_cache_groups) == 1
        told = told if one_group else set()
    report(
        scheduler, output, finished_recving={request.request_id}, invalid_block_ids=told, **failed
    )
    return request, held, scheduler.schedule()


def hashed_request(request_id, prompt_tokens, params, hasher) -> Request:
    """A remote-prefill request whose blocks vLLM's prefix cache can find."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, prompt_tokens + 1)),
        sampling_params=SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}),
        pooling_params=None,
        block_hasher=hasher,
    )


def remote_params(scheduler, prompt_tokens=PROMPT_TOKENS):
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
    logical = -(-prompt_tokens // scheduler.block_size)
    ids = list(range(1, logical + 1))
    params["remote_block_ids"] = ids if groups == 1 else [ids] * groups
    return params


def resumed_at(request, next_output) -> int:
    """The token the request's next forward pass starts at."""
    return request.num_tokens - next_output.num_scheduled_tokens[request.request_id]


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
    """Why ours departs on 0.21.0 (the check above fails on upstream's
    scheduler there): upstream resumes an every-layer-window request at the
    window's first block, with null blocks where the window's start should
    be. 0.33's scheduler does the same with invalid blocks alone; a request
    in ``failed_recving`` it recomputes from token 0, which is how ours
    reports every failed read there."""
    vllm_config, kv_cache_config = engine_config(window_layout("swa-only", 40), False, tmp_path)
    scheduler = build_scheduler(vllm_config, kv_cache_config, "recompute", Scheduler)
    request, (held,), next_output = fail_the_load(scheduler, invalid_only=True)
    start = resumed_at(request, next_output)
    assert start > 0
    window_start_block = (start - 40 + 1) // scheduler.block_size
    assert held[window_start_block] == NULL_BLOCK_ID, held


@pytest.mark.skipif(
    _compat.builds_on("v033"),
    reason="vLLM 0.33.0's scheduler asserts in BlockPool.cache_full_blocks (block_mask length) "
    "when it places this test's second request (one sliding-window group, a local hit, the "
    "rest remote), before any failure; whether an engine meets it is not established (no "
    "0.33 engine runs here; docs/faults.md). 0.33 recomputes a failed request from token 0 "
    "by itself (test_recompute_resumes_only_where_every_block_read_is_held)",
)
def test_a_decode_side_hit_is_found_again_and_holds_the_window(tmp_path):
    """With prefix caching on decode: a request that hit 10 cached blocks and
    failed to load the rest starts over (its window's blocks past the hit
    were null), vLLM frees it and finds the hit again with fresh blocks, and
    it resumes after the hit with every block its window reads held."""
    vllm_config, kv_cache_config = engine_config(
        window_layout("swa-only", 40), False, tmp_path, enable_prefix_caching=True
    )
    scheduler = build_scheduler(vllm_config, kv_cache_config, "recompute")
    hasher = block_hasher(vllm_config, kv_cache_config)
    block_tokens = scheduler.block_size
    first_tokens = 10 * block_tokens + 1  # its KV arrives; vLLM caches 10 blocks
    first = hashed_request("turn-1", first_tokens, remote_params(scheduler, first_tokens), hasher)
    scheduler.add_request(first)
    output = scheduler.schedule()
    report(scheduler, output, finished_recving={"turn-1"})  # vLLM caches what arrived
    output = scheduler.schedule()  # its last prompt token: one token sampled, then aborted
    scheduler.update_from_output(output, runner_output(["turn-1"], sampled_token_ids=[[7]]))
    scheduler.finish_requests("turn-1", RequestStatus.FINISHED_ABORTED)  # its blocks stay cached
    second_tokens = 19 * block_tokens - 4  # 9 blocks past the hit: its window, and more
    second = hashed_request(
        "turn-2", second_tokens, remote_params(scheduler, second_tokens), hasher
    )
    request, (held,), next_output = fail_the_load(scheduler, second)
    assert NULL_BLOCK_ID in held[:10]  # the hit, outside the window at the prompt's end
    start = resumed_at(request, next_output)
    assert start == 10 * block_tokens
    (now,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    window_start_block = (start - 40 + 1) // block_tokens
    assert NULL_BLOCK_ID not in now[window_start_block : start // block_tokens], now


@pytest.mark.parametrize("window", [8, 40])
def test_a_prefill_list_cut_short_is_refused_where_counts_would_pair_it(window, tmp_path):
    """Decode's real lists for an every-layer window (vLLM's scheduler, with
    our connector's scheduler side handing the span): with a window shorter
    than a block decode reads one block, so pairing by counts takes any
    prefill list of one block, the first block of the prompt included (the
    e2e ``unpairable-block-lists`` cell answered HTTP 200 with wrong tokens
    under both policies on the ``swa-only-8`` model). The span says how many
    tokens prefill holds, so how long its list is: a cut list is refused,
    the genuine one, whole or clipped to the window as vLLM's prefill clips
    it under HMA, passes; on 0.33 through our worker's
    ``_apply_prefix_caching`` (0.21's ``_read_blocks``:
    tests/unit/test_worker_read_path.py)."""
    from vllm_nixl_hma.core import blocks, positions
    from vllm_nixl_hma.core.errors import BlockAlignmentError
    from vllm_nixl_hma.core.groups import group_kinds, group_windows

    vllm_config, kv_cache_config = engine_config(window_layout("swa-only", window), False, tmp_path)
    scheduler = build_scheduler(vllm_config, kv_cache_config, "fail")
    params = remote_params(scheduler)
    request = remote_prefill_request(params=params)
    scheduler.add_request(request)
    output = scheduler.schedule()
    metadata = output.kv_connector_metadata
    (decode_ids,) = metadata.reqs_to_recv[request.request_id].local_block_ids
    span = getattr(metadata, positions.METADATA_ATTR)[request.request_id]
    assert span == positions.TokenSpan(0, PROMPT_TOKENS)
    block_tokens = scheduler.block_size
    # decode holds the window's blocks only: one for a window shorter than a block
    window_blocks = len(
        range((PROMPT_TOKENS - window) // block_tokens, -(-PROMPT_TOKENS // block_tokens))
    )
    assert len(decode_ids) == window_blocks, decode_ids
    groups = getattr(kv_cache_config, "transfer_groups", kv_cache_config.kv_cache_groups)
    kinds, windows = group_kinds(groups), group_windows(groups)
    assert windows == (window,)
    whole = params["remote_block_ids"]  # one id per logical block of the prompt, from token 0
    # vLLM's prefill under HMA: the last cdiv(window, block) + 1 blocks
    clipped = whole[-(-(-window // block_tokens) + 1) :]
    cut = whole[:1]

    def check(prefill_ids):
        positions.check_prefill_lists(
            [prefill_ids], kinds, windows, span, block_tokens, remote_physical_per_logical=1
        )

    check(whole)
    check(clipped)
    with pytest.raises(
        BlockAlignmentError, match=f"local='{len(clipped)} or {len(whole)}', remote=1"
    ):
        check(cut)
    if window_blocks == 1:
        # the count rule pairs the cut list: decode's block would get the prompt's first
        _, (paired,) = blocks.align_kernel_ids_by_group([decode_ids], [cut], kinds, 1, 1)
        assert paired.tolist() == [whole[0]]
    else:
        with pytest.raises(BlockAlignmentError):
            blocks.align_kernel_ids_by_group([decode_ids], [cut], kinds, 1, 1)
    if _compat.builds_on("v033"):
        from vllm_nixl_hma.v033.worker import NixlHMAConnectorWorker

        worker = object.__new__(NixlHMAConnectorWorker)
        worker.kv_cache_config = kv_cache_config
        worker._has_mamba = False
        worker.block_size = block_tokens
        worker._pairs_by_position = False
        worker._span_being_read = span
        worker._prefill_kernel_tokens_being_read = block_tokens
        with pytest.raises(BlockAlignmentError, match="prefill kernel block count of group 0"):
            worker._apply_prefix_caching([decode_ids], [cut], 1, 1)
        assert worker._apply_prefix_caching([decode_ids], [whole], 1, 1) == (
            [list(decode_ids)],
            [whole[-len(decode_ids) :]],
        )
