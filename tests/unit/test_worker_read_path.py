"""The decode read path of the worker, from logical ids to NIXL descriptors.

Each test runs vLLM 0.21.0's real ``_logical_to_kernel_block_ids``,
``_read_blocks_for_req``, ``_compute_desc_ids`` and (through ours) the real
``_read_blocks`` on a worker built around real vLLM KV cache specs, transfer
topology and TP mapping. Only the NIXL agent is a fake that records the
descriptor ids of ``make_prepped_xfer``: these tests are about which blocks
are asked for; tests/integration moves real bytes.

The same cases run against stock ``NixlConnectorWorker``: docs/design.md section 3's rows
must fail there, which shows the checks can catch the bug.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata,
    RemoteMeta,
    ReqMeta,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

from tests.reference import FULL, MAMBA, SWA, build_side, pairing_errors
from vllm_nixl_hma import NixlHMAConnectorWorker
from vllm_nixl_hma.core.errors import IncompatibleRemoteError
from vllm_nixl_hma.core.positions import TokenSpan
from vllm_nixl_hma.harness.read_path import (
    LOCAL_XFER_HANDLE,
    REMOTE_ENGINE,
    REMOTE_XFER_HANDLE,
    build_read_path_worker,
)

KERNEL_BLOCK_TOKENS = 16
LOGICAL_BLOCKS = 64
WINDOW_TOKENS = 40


def read_path_worker(worker_cls, group_kinds, local_ratio, remote_ratio, nixl_wrapper):
    return build_read_path_worker(
        worker_cls,
        group_kinds,
        local_ratio,
        remote_ratio,
        nixl_wrapper,
        logical_blocks=LOGICAL_BLOCKS,
        kernel_block_tokens=KERNEL_BLOCK_TOKENS,
        window_tokens=WINDOW_TOKENS,
    )


def decode_desc_ids(desc_ids, num_kernel_blocks, physical_per_logical, has_mamba):
    """Descriptor ids -> (region kind, region, block id), as _compute_desc_ids lays them out."""
    num_fa_descs = 2 * num_kernel_blocks
    logical_blocks = num_kernel_blocks // physical_per_logical
    decoded = []
    for desc_id in np.asarray(desc_ids).tolist():
        if desc_id < num_fa_descs:
            decoded.append(("fa", desc_id // num_kernel_blocks, desc_id % num_kernel_blocks))
        else:
            assert has_mamba
            ssm = desc_id - num_fa_descs
            decoded.append(("ssm", ssm // logical_blocks, ssm % logical_blocks))
    return decoded


def read_request(worker, request_id, local_block_ids, remote_block_ids, remote_request_id):
    """What start_load_kv does for one request before _read_blocks_for_req, then that."""
    meta = ReqMeta(
        local_block_ids=local_block_ids,
        local_physical_block_ids=[],
        tp_size=1,
        remote=RemoteMeta(
            block_ids=remote_block_ids,
            host="127.0.0.1",
            port=5600,
            engine_id=REMOTE_ENGINE,
            request_id=remote_request_id,
        ),
    )
    meta.local_physical_block_ids = worker._logical_to_kernel_block_ids(meta.local_block_ids)
    worker._read_blocks_for_req(request_id, meta)


def run_read_path(
    worker_cls,
    group_kinds,
    local_ratio,
    remote_ratio,
    num_tokens,
    seed,
    mocker,
    hit_logical_blocks=0,
    null_padded_mamba=False,
):
    """Run one request through the read path; return the oracle's complaints.

    ``hit_logical_blocks``: decode's own prefix-cache hit (its list starts
    after it); our worker is then handed the request's token span, as our
    scheduler side hands it. ``null_padded_mamba``: prefill's Mamba list as
    vLLM's mode ``align`` sends it, null blocks and the state last."""
    rng = random.Random(seed)
    local = build_side(
        num_tokens,
        group_kinds,
        local_ratio,
        KERNEL_BLOCK_TOKENS,
        rng,
        prefix_hit_logical_blocks=hit_logical_blocks,
        window_tokens=WINDOW_TOKENS,
        pool_logical_blocks=LOGICAL_BLOCKS,
    )
    remote = build_side(
        num_tokens,
        group_kinds,
        remote_ratio,
        KERNEL_BLOCK_TOKENS,
        rng,
        window_tokens=WINDOW_TOKENS,
        pool_logical_blocks=LOGICAL_BLOCKS,
    )
    nixl_wrapper = mocker.Mock()
    nixl_wrapper.make_prepped_xfer.return_value = 7
    worker = read_path_worker(worker_cls, group_kinds, local_ratio, remote_ratio, nixl_wrapper)
    remote_block_ids = [list(g) for g in remote.logical_ids_by_group]
    if null_padded_mamba:
        logical_count = -(-num_tokens // (KERNEL_BLOCK_TOKENS * remote_ratio))
        remote_block_ids = [
            [0] * (logical_count - 1) + ids if kind == MAMBA else ids
            for ids, kind in zip(remote_block_ids, group_kinds, strict=True)
        ]
    if worker_cls is NixlHMAConnectorWorker and (hit_logical_blocks or null_padded_mamba):
        # what our scheduler side hands the worker, with prefix caching of a hybrid
        worker._pairs_by_position = True
        hit_tokens = hit_logical_blocks * KERNEL_BLOCK_TOKENS * local_ratio
        worker._token_spans["req-1"] = TokenSpan(hit_tokens, num_tokens)
    read_request(
        worker,
        "req-1",
        [list(g) for g in local.logical_ids_by_group],
        remote_block_ids,
        "prefill-req-1",
    )

    assert nixl_wrapper.make_prepped_xfer.call_count == 1, worker._failed_recv_reqs
    args = nixl_wrapper.make_prepped_xfer.call_args.args
    assert args[0] == "READ" and args[1] == LOCAL_XFER_HANDLE and args[3] == REMOTE_XFER_HANDLE
    local_descs = decode_desc_ids(
        args[2], LOGICAL_BLOCKS * local_ratio, local_ratio, MAMBA in group_kinds
    )
    remote_descs = decode_desc_ids(
        args[4], LOGICAL_BLOCKS * remote_ratio, remote_ratio, MAMBA in group_kinds
    )
    assert len(local_descs) == len(remote_descs)

    # Attribute each region-0 pair to its group by the local id, then judge.
    pairs_by_group = [([], []) for _ in group_kinds]
    for (l_kind, l_region, l_id), (r_kind, r_region, r_id) in zip(
        local_descs, remote_descs, strict=True
    ):
        assert (l_kind, l_region) == (r_kind, r_region)
        if l_region != 0:
            continue
        for group, kind in enumerate(group_kinds):
            owns = (
                l_id == local.state_id_by_group[group]
                if kind == MAMBA
                else l_id in local.kernel_index_by_group[group]
            )
            if owns and (l_kind == "ssm") == (kind == MAMBA):
                pairs_by_group[group][0].append(l_id)
                pairs_by_group[group][1].append(r_id)
                break
        else:
            raise AssertionError(f"local {l_kind} block {l_id} belongs to no group")
    return pairing_errors(
        local,
        remote,
        num_tokens,
        [p[0] for p in pairs_by_group],
        [p[1] for p in pairs_by_group],
    )


# (group kinds, local ratio, remote ratio, prompt tokens)
DESIGN_ROWS = [
    # docs/design.md section 3, row 1: local r=10, remote r=6 (196 tokens: local 2 logical
    # blocks, 20 kernel blocks; remote 3 logical blocks, 18 kernel blocks)
    pytest.param([FULL, MAMBA], 10, 6, 100 + 6 * KERNEL_BLOCK_TOKENS, id="row1-local10-remote6"),
    # docs/design.md section 3, row 2: local r=6, remote r=10, remote logical [x] (1 block)
    pytest.param([FULL, MAMBA], 6, 10, 6 * KERNEL_BLOCK_TOKENS + 5, id="row2-local6-remote10"),
    # Nemotron-3-Nano-like: TP1 r=66 prefill, TP4 r=34 decode, prompt ends mid block
    pytest.param([MAMBA, FULL], 34, 66, 3 * 66 * KERNEL_BLOCK_TOKENS - 7, id="nemotron-34-66"),
    pytest.param([FULL, MAMBA, FULL], 66, 34, 40 * KERNEL_BLOCK_TOKENS, id="nemotron-66-34"),
]

HOMOGENEOUS_ROWS = [
    pytest.param([FULL], 1, 1, 77, id="dense-r1"),
    pytest.param([FULL], 4, 4, 200, id="dense-r4"),
    pytest.param([FULL, SWA], 2, 2, 300, id="swa-r2"),
    pytest.param([FULL, MAMBA], 6, 6, 6 * KERNEL_BLOCK_TOKENS * 3, id="hybrid-equal-boundary"),
    pytest.param([FULL, MAMBA], 10, 10, 1000, id="hybrid-equal-mid-block"),
]


@pytest.mark.parametrize(("kinds", "local_ratio", "remote_ratio", "tokens"), DESIGN_ROWS)
def test_ours_reads_the_right_kernel_blocks_with_unequal_ratios(
    kinds, local_ratio, remote_ratio, tokens, mocker
):
    for seed in range(5):
        assert (
            run_read_path(
                NixlHMAConnectorWorker, kinds, local_ratio, remote_ratio, tokens, seed, mocker
            )
            == []
        )


@pytest.mark.parametrize(("kinds", "local_ratio", "remote_ratio", "tokens"), HOMOGENEOUS_ROWS)
def test_ours_and_stock_agree_with_equal_ratios(kinds, local_ratio, remote_ratio, tokens, mocker):
    """Homogeneous setups, where 0.21.0 is right: ours keeps its behaviour."""
    for worker_cls in (NixlHMAConnectorWorker, NixlConnectorWorker):
        assert run_read_path(worker_cls, kinds, local_ratio, remote_ratio, tokens, 3, mocker) == []


@pytest.mark.parametrize(("kinds", "local_ratio", "remote_ratio", "tokens"), DESIGN_ROWS)
def test_stock_0_21_0_fails_the_same_rows(kinds, local_ratio, remote_ratio, tokens, mocker):
    """The checks above can fail: stock 0.21.0 reads wrong blocks or asserts."""
    try:
        errors = run_read_path(
            NixlConnectorWorker, kinds, local_ratio, remote_ratio, tokens, 0, mocker
        )
    except AssertionError as e:  # 0.21.0's own assert in _read_blocks, or ours above
        errors = [f"assertion: {e}"]
    assert errors != []


# (group kinds, local ratio, remote ratio, prompt tokens, decode hit in decode logical blocks)
DECODE_HIT_ROWS = [
    # hit inside a prefill logical block (decode 80 tokens, prefill 48)
    pytest.param([FULL, MAMBA], 5, 3, 200, 1, id="hybrid-5-3-hit-inside"),
    pytest.param([FULL, MAMBA], 5, 3, 190, 1, id="hybrid-5-3-tail-rule-misreads"),
    # hit on a boundary of both sides (decode 48, prefill 80: 240 tokens)
    pytest.param([FULL, MAMBA], 3, 5, 300, 5, id="hybrid-3-5-hit-on-both-boundaries"),
    # all but the last decode block
    pytest.param([MAMBA, FULL], 10, 6, 4 * 160 + 3, 4, id="hybrid-10-6-all-but-last"),
    pytest.param([FULL, MAMBA, FULL], 6, 10, 7 * 96 + 9, 3, id="hybrid-6-10-two-groups"),
]


@pytest.mark.parametrize(("kinds", "local_ratio", "remote_ratio", "tokens", "hit"), DECODE_HIT_ROWS)
def test_ours_pairs_a_decode_hit_by_token_position(
    kinds, local_ratio, remote_ratio, tokens, hit, mocker
):
    """Decode holds ``hit`` logical blocks of the prompt already and reads the
    rest; prefill's Mamba list is as mode ``align`` sends it (#26)."""
    for seed in range(3):
        errors = run_read_path(
            NixlHMAConnectorWorker,
            kinds,
            local_ratio,
            remote_ratio,
            tokens,
            seed,
            mocker,
            hit_logical_blocks=hit,
            null_padded_mamba=True,
        )
        assert errors == []


@pytest.mark.parametrize(("kinds", "local_ratio", "remote_ratio", "tokens", "hit"), DECODE_HIT_ROWS)
def test_stock_0_21_0_misreads_or_asserts_on_the_same_decode_hits(
    kinds, local_ratio, remote_ratio, tokens, hit, mocker
):
    """The check above can fail: stock pairs from the tail (prefill's list as
    without prefix caching, so only the pairing rule is on trial)."""
    try:
        errors = run_read_path(
            NixlConnectorWorker,
            kinds,
            local_ratio,
            remote_ratio,
            tokens,
            0,
            mocker,
            hit_logical_blocks=hit,
        )
    except AssertionError as e:
        errors = [f"assertion: {e}"]
    assert errors != []


def test_unalignable_lists_fail_the_request_before_any_read(mocker):
    nixl_wrapper = mocker.Mock()
    worker = read_path_worker(NixlHMAConnectorWorker, [FULL, MAMBA], 6, 10, nixl_wrapper)
    meta = ReqMeta(
        local_block_ids=[[1, 2, 3, 4], [9]],  # 24 kernel blocks (r=6)
        local_physical_block_ids=[],
        tp_size=1,
        remote=RemoteMeta(
            block_ids=[[6], [5]],  # 10 kernel blocks (r=10): 14 apart, more than rounding
            host="127.0.0.1",
            port=5600,
            engine_id=REMOTE_ENGINE,
            request_id="p-1",
        ),
    )
    meta.local_physical_block_ids = worker._logical_to_kernel_block_ids(meta.local_block_ids)
    worker._read_blocks_for_req("req-bad", meta)
    nixl_wrapper.make_prepped_xfer.assert_not_called()
    nixl_wrapper.transfer.assert_not_called()
    assert worker._failed_recv_reqs == {"req-bad"}


def agent_metadata(remote_ratio: int) -> NixlAgentMetadata:
    return NixlAgentMetadata(
        engine_id=REMOTE_ENGINE,
        agent_metadata=b"",
        kv_caches_base_addr=[0, 0],
        device_id=0,
        num_blocks=LOGICAL_BLOCKS * remote_ratio,
        block_lens=[1024, 1024],
        kv_cache_layout="HND",
        block_size=KERNEL_BLOCK_TOKENS,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASHINFER",
        physical_blocks_per_logical_kv_block=remote_ratio,
    )


@pytest.mark.parametrize(
    ("kinds", "prefix_caching", "extra_config", "refused"),
    [
        # a dense model keeps the count rules: a hit would misalign them
        pytest.param([FULL], True, {}, True, id="dense-prefix-caching"),
        # the operator said no: the count rules again
        pytest.param(
            [FULL, MAMBA], True, {"mamba_prefix_caching": False}, True, id="hybrid-said-no"
        ),
        # a hybrid with prefix caching pairs by token position (#26)
        pytest.param([FULL, MAMBA], True, {}, False, id="hybrid-pairs-by-position"),
        pytest.param([FULL, MAMBA], False, {}, False, id="hybrid-no-prefix-caching"),
    ],
)
def test_handshake_refuses_unequal_ratios_with_prefix_caching_before_upstream_checks(
    kinds, prefix_caching, extra_config, refused, mocker
):
    upstream = mocker.patch.object(NixlConnectorWorker, "_validate_remote_agent_handshake")
    worker = read_path_worker(NixlHMAConnectorWorker, kinds, 10, 6, mocker.Mock())
    worker.vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching)
    )
    worker.kv_transfer_config = SimpleNamespace(kv_connector_extra_config=extra_config)
    if refused:
        with pytest.raises(RuntimeError, match="--no-enable-prefix-caching") as info:
            worker._validate_remote_agent_handshake(agent_metadata(6), 1)
        assert isinstance(info.value, IncompatibleRemoteError)
        assert "local=10" in str(info.value) and "remote=6" in str(info.value)
        upstream.assert_not_called()
    else:
        worker._validate_remote_agent_handshake(agent_metadata(6), 1)
        upstream.assert_called_once()


#: an every-layer window of 8 tokens, shorter than a kernel block of 16: a
#: 104-token prompt's window (tokens 96..103) lies in its 7th block alone
SHORT_WINDOW_TOKENS = 8
SHORT_WINDOW_PROMPT = 104
GENUINE_PREFILL_LIST = [11, 12, 13, 14, 15, 16, 17]  # the prompt's 7 blocks from token 0


def short_window_read(worker_cls, prefill_ids, mocker):
    """Decode reads a 104-token prompt of a one-group, window-8 model (as
    vLLM runs it without HMA) into its one window block (41), with our
    scheduler side's span; returns the NIXL mock and the worker."""
    nixl_wrapper = mocker.Mock()
    nixl_wrapper.make_prepped_xfer.return_value = 7
    worker = build_read_path_worker(
        worker_cls,
        [SWA],
        1,
        1,
        nixl_wrapper,
        logical_blocks=LOGICAL_BLOCKS,
        kernel_block_tokens=KERNEL_BLOCK_TOKENS,
        window_tokens=SHORT_WINDOW_TOKENS,
    )
    if worker_cls is NixlHMAConnectorWorker:
        worker._token_spans["req-1"] = TokenSpan(0, SHORT_WINDOW_PROMPT)
    read_request(worker, "req-1", [[41]], [list(prefill_ids)], "prefill-req-1")
    return nixl_wrapper, worker


def remote_blocks_read(nixl_wrapper) -> list[int]:
    (call,) = nixl_wrapper.make_prepped_xfer.call_args_list
    return sorted(
        {block for _, _, block in decode_desc_ids(call.args[4], LOGICAL_BLOCKS, 1, False)}
    )


@pytest.mark.parametrize(
    "prefill_ids",
    [
        pytest.param(GENUINE_PREFILL_LIST, id="whole"),
        pytest.param(GENUINE_PREFILL_LIST[-2:], id="clipped-to-the-window-as-under-hma"),
        pytest.param([0, 0, 0, 0, 0, 16, 17], id="null-before-the-window"),
    ],
)
def test_a_window_shorter_than_a_block_reads_the_prompts_last_block(prefill_ids, mocker):
    nixl_wrapper, worker = short_window_read(NixlHMAConnectorWorker, prefill_ids, mocker)
    assert worker._failed_recv_reqs == set()
    assert remote_blocks_read(nixl_wrapper) == [17]


def test_a_prefill_list_that_fits_decodes_one_block_but_not_the_prompt_is_refused(mocker, caplog):
    """Issue #41's window-8 cell: decode needs one block, so the count rule
    pairs any list of one block. Ours knows the prompt's length from the
    span and refuses before any read; stock reads prefill's block 11 (tokens
    0..15) into the window's block and decodes on it."""
    prefill_ids = GENUINE_PREFILL_LIST[:1]
    nixl_wrapper, worker = short_window_read(NixlHMAConnectorWorker, prefill_ids, mocker)
    nixl_wrapper.make_prepped_xfer.assert_not_called()
    assert worker._failed_recv_reqs == {"req-1"}
    assert "local='2 or 7', remote=1" in caplog.text

    stock_nixl, stock = short_window_read(NixlConnectorWorker, prefill_ids, mocker)
    assert stock._failed_recv_reqs == set()
    assert remote_blocks_read(stock_nixl) == [prefill_ids[-1]] != [17]
