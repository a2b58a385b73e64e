"""A decode-side prefix-cache hit through vLLM's real scheduler (#26), on
both releases (the vLLM 0.33 part of tools/test.sh runs this file too).

The hybrid's decode engine (prefix caching kept by ``mamba_prefix_caching``,
Mamba cache mode 'align') receives one remote-prefill request, which vLLM
caches once its KV arrived; a second request extends the same prompt. vLLM's
own KV cache manager finds the hit; our ``build_connector_meta`` must hand the
worker the span vLLM decided on (the hit, and the tokens prefill holds), and
upstream's local lists must start right after the hit: the pairing by token
position (``core/positions.py``) rests on both. The check harness proves the
pairing on real bytes; e2e the whole path through real engines.
"""

from __future__ import annotations

import copy

import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from tests.integration.test_scheduler_failures import build_scheduler, report
from vllm_nixl_hma import _compat
from vllm_nixl_hma.core import positions
from vllm_nixl_hma.harness import coordinator, layout
from vllm_nixl_hma.harness.model_shapes import installed_layouts

pytestmark = pytest.mark.slow

#: Mamba cache modes the installed vLLM offers with prefix caching (0.33 has no 'all')
MODES = ["align"] if _compat.builds_on("v033") else ["align", "all"]


@pytest.fixture(scope="module", params=MODES)
def hybrid_config(request, tmp_path_factory):
    model_dir = coordinator.model_dir_for(
        installed_layouts()["hybrid"], tmp_path_factory.mktemp("m")
    )
    vllm_config = layout.build_vllm_config(
        model_dir,
        1,
        "NixlHMAConnector",
        "decode-engine",
        "kv_consumer",
        256,
        4096,
        enable_prefix_caching=True,
        mamba_cache_mode=None if request.param == "align" else request.param,
    )
    with layout.single_process_tp_group(vllm_config):
        kv_cache_config = layout.build_engine_layout(vllm_config, 0).kv_cache_config
    return vllm_config, kv_cache_config


def block_hasher(vllm_config, kv_cache_config):
    """The hasher vLLM's engine core gives each request it builds."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )

    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    _, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return get_request_block_hasher(hash_block_size, hash_fn)


def remote_prefill(request_id: str, prompt_tokens: int, hasher=None) -> Request:
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1], [2]],
        "remote_engine_id": "prefill-engine",
        "remote_request_id": f"prefill-{request_id}",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "tp_size": 1,
    }
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, prompt_tokens + 1)),
        sampling_params=SamplingParams(
            max_tokens=4, extra_args={"kv_transfer_params": copy.deepcopy(params)}
        ),
        pooling_params=None,
        block_hasher=hasher,
    )


def test_the_opt_in_keeps_prefix_caching_in_the_mode_asked_for(hybrid_config):
    """Not given: 'align' (the config hook's choice); 'all' when given."""
    vllm_config, kv_cache_config = hybrid_config
    assert vllm_config.cache_config.enable_prefix_caching
    assert vllm_config.cache_config.mamba_cache_mode in MODES
    mamba = [
        group.kv_cache_spec
        for group in kv_cache_config.kv_cache_groups
        if type(group.kv_cache_spec).__name__ == "MambaSpec"
    ]
    assert mamba and all(
        spec.mamba_cache_mode == vllm_config.cache_config.mamba_cache_mode for spec in mamba
    )
    assert len(kv_cache_config.kv_cache_groups) > 1


def test_a_second_turn_gets_the_span_of_its_local_hit(hybrid_config):
    vllm_config, kv_cache_config = hybrid_config
    scheduler = build_scheduler(vllm_config, kv_cache_config, "fail")
    block_tokens = scheduler.block_size  # decode's logical block (one Mamba state per block)
    first_turn_blocks = 3
    # prefill holds the prompt less its last token, whole blocks of it here,
    # so that the Mamba state at its end is cached too
    hasher = block_hasher(vllm_config, kv_cache_config)
    first = remote_prefill("turn-1", first_turn_blocks * block_tokens + 1, hasher)
    scheduler.add_request(first)
    output = scheduler.schedule()
    assert first.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    spans = getattr(output.kv_connector_metadata, positions.METADATA_ATTR)
    assert spans == {"turn-1": positions.TokenSpan(0, first_turn_blocks * block_tokens)}
    first_blocks = scheduler.kv_cache_manager.get_block_ids("turn-1")
    report(scheduler, output, finished_recving={"turn-1"})  # the KV arrived: vLLM caches it
    scheduler.schedule()

    second = remote_prefill(
        "turn-2", first_turn_blocks * block_tokens + 1 + 2 * block_tokens + 5, hasher
    )
    scheduler.add_request(second)
    output = scheduler.schedule()
    assert second.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    metadata = output.kv_connector_metadata
    span = getattr(metadata, positions.METADATA_ATTR)["turn-2"]
    hit = first_turn_blocks * block_tokens
    assert span == positions.TokenSpan(hit, len(second.prompt_token_ids) - 1)
    # the hit is vLLM's own: the second turn shares the first turn's blocks
    second_blocks = scheduler.kv_cache_manager.get_block_ids("turn-2")
    attention = next(
        index
        for index, group in enumerate(kv_cache_config.kv_cache_groups)
        if type(group.kv_cache_spec).__name__ != "MambaSpec"
    )
    shared = first_turn_blocks
    assert second_blocks[attention][:shared] == first_blocks[attention][:shared]
    # upstream hands the worker the blocks after the hit only: what the span says
    local = metadata.reqs_to_recv["turn-2"].local_block_ids
    assert local[attention] == second_blocks[attention][first_turn_blocks:]
    assert len(local[attention]) == -(-span.prefill_tokens // block_tokens) - first_turn_blocks
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if index != attention and type(group.kv_cache_spec).__name__ == "MambaSpec":
            assert len(local[index]) == 1  # the one state block decode receives into
            # in 'all' as in 'align': every block before the running state is
            # vLLM's null block, so decode holds (and will cache) no boundary
            # state it did not receive
            for blocks in (first_blocks[index], second_blocks[index]):
                assert set(blocks[:-1]) == {positions.NULL_BLOCK_ID}, blocks
                assert blocks[-1] != positions.NULL_BLOCK_ID
            assert local[index] == second_blocks[index][-1:]


def test_a_prompt_without_a_hit_reads_from_token_zero(hybrid_config):
    scheduler = build_scheduler(*hybrid_config, "fail")
    request = remote_prefill("alone", 77)
    scheduler.add_request(request)
    output = scheduler.schedule()
    spans = getattr(output.kv_connector_metadata, positions.METADATA_ATTR)
    assert spans == {"alone": positions.TokenSpan(0, 76)}
