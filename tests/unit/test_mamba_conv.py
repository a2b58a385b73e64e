"""vllm_nixl_hma.core.mamba_conv against a byte-level simulation of P and D conv pages.

Every byte of a rank's conv page is labelled with the global channel it belongs to
(``channel id * row bytes + byte in row``), so a read that puts B where C belongs, or
a half of group 0's states in the other half, shows up as a wrong label.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from vllm_nixl_hma.core.mamba_conv import (
    GatedDeltaNetState,
    Mamba2State,
    ReadSlice,
    conv_channel_ids,
    conv_read_plan,
    conv_regions,
    groups_replicated,
    padded_n_groups,
    plan_by_p_rank,
    respects_vllm_local_splits,
    source_p_ranks,
    ssm_head_ids,
    ssm_read_plan,
    stock_conv_read_plan,
    stock_ssm_read_plan,
)

TP_SIZES = (1, 2, 4, 8)
N_GROUPS = (1, 2, 4, 8)
D_STATES = (2, 3, 16)
NUM_HEADS = 8  # divisible by every TP size
HEAD_DIM = 2
INTERMEDIATE = NUM_HEADS * HEAD_DIM
CONV_ROWS = 3
DTYPE_SIZE = 2
ROW_BYTES = CONV_ROWS * DTYPE_SIZE
UNWRITTEN = -2
OUT_OF_CONV = -1


def supported(n_groups: int, tp: int) -> bool:
    """MambaMixer2.__init__'s assert in vLLM 0.21.0."""
    return n_groups % tp == 0 or n_groups == 1


TP_PAIRS = [(p, d) for p, d in itertools.product(TP_SIZES, TP_SIZES) if p % d == 0 or d % p == 0]
CASES = [
    (g, d_state, p, d)
    for g, d_state, (p, d) in itertools.product(N_GROUPS, D_STATES, TP_PAIRS)
    if supported(g, p) and supported(g, d)
]


def mamba2(n_groups: int, d_state: int) -> Mamba2State:
    return Mamba2State(INTERMEDIATE, n_groups, d_state, NUM_HEADS)


def shape(n_groups: int, d_state: int) -> tuple[Mamba2State, int, int]:
    return (mamba2(n_groups, d_state), CONV_ROWS, DTYPE_SIZE)


def byte_labels(channel_ids: np.ndarray, row_bytes: int = ROW_BYTES) -> np.ndarray:
    """DS layout: each channel's rows are contiguous bytes."""
    return (channel_ids[:, None] * row_bytes + np.arange(row_bytes)[None, :]).ravel()


def p_page(n_groups: int, d_state: int, p_tp: int, p_rank: int) -> np.ndarray:
    ids = conv_channel_ids(mamba2(n_groups, d_state), p_tp, p_rank)
    return byte_labels(ids)


def read(page: np.ndarray, offset_bytes: int, size_bytes: int) -> np.ndarray:
    """Bytes past the conv state (SSM state or beyond) are not conv channels."""
    idx = np.arange(offset_bytes, offset_bytes + size_bytes)
    out = np.full(size_bytes, OUT_OF_CONV, dtype=np.int64)
    inside = (idx >= 0) & (idx < page.size)
    out[inside] = page[idx[inside]]
    return out


def apply_plan(plan, p_pages: dict[int, np.ndarray], d_page_bytes: int) -> np.ndarray:
    d_page = np.full(d_page_bytes, UNWRITTEN, dtype=np.int64)
    for r in plan:
        d_page[r.local_offset_bytes : r.local_offset_bytes + r.size_bytes] = read(
            p_pages[r.p_rank], r.remote_offset_bytes, r.size_bytes
        )
    return d_page


def simulate(plan_fn, n_groups, d_state, p_tp, d_tp, d_rank):
    """(received, expected) byte labels of decode rank ``d_rank``'s conv page."""
    plan = plan_fn(*shape(n_groups, d_state), p_tp, d_tp, d_rank)
    pages = {p: p_page(n_groups, d_state, p_tp, p) for p in source_p_ranks(p_tp, d_tp, d_rank)}
    expected = byte_labels(conv_channel_ids(mamba2(n_groups, d_state), d_tp, d_rank))
    return apply_plan(plan, pages, expected.size), expected


# ----------------------------------------------------------------------------
# conv_channel_ids / ssm_head_ids
# ----------------------------------------------------------------------------


def test_channel_ids_one_replicated_group():
    # I=4, 1 group of 2 states: each of 2 ranks holds half of x and all of group 0.
    assert conv_channel_ids(Mamba2State(4, 1, 2, 2), 2, 0).tolist() == [0, 1, 4, 5, 6, 7]
    assert conv_channel_ids(Mamba2State(4, 1, 2, 2), 2, 1).tolist() == [2, 3, 4, 5, 6, 7]


def test_channel_ids_sharded_groups():
    # I=4, 2 groups of 2 states, TP 2: rank r holds group r of B and of C.
    assert conv_channel_ids(Mamba2State(4, 2, 2, 2), 2, 0).tolist() == [0, 1, 4, 5, 8, 9]
    assert conv_channel_ids(Mamba2State(4, 2, 2, 2), 2, 1).tolist() == [2, 3, 6, 7, 10, 11]


@pytest.mark.parametrize(("n_groups", "tp"), list(itertools.product(N_GROUPS, TP_SIZES)))
def test_channel_ids_cover_the_model_and_match_the_state_shape(n_groups, tp):
    if not supported(n_groups, tp):
        with pytest.raises(ValueError, match="n_groups"):
            conv_channel_ids(mamba2(n_groups, 3), tp, 0)
        return
    d_state = 3
    per_rank = [conv_channel_ids(mamba2(n_groups, d_state), tp, r) for r in range(tp)]
    conv_dim_local = (INTERMEDIATE + 2 * padded_n_groups(n_groups, tp) * d_state) // tp
    assert all(ids.size == conv_dim_local for ids in per_rank)
    assert all(np.unique(ids).size == ids.size for ids in per_rank)
    union = np.unique(np.concatenate(per_rank))
    assert union.tolist() == list(range(INTERMEDIATE + 2 * n_groups * d_state))
    x_union = np.concatenate([ids[ids < INTERMEDIATE] for ids in per_rank])
    assert x_union.tolist() == list(range(INTERMEDIATE))  # x is sharded in rank order
    if groups_replicated(n_groups, tp):
        assert all(
            np.array_equal(ids[INTERMEDIATE // tp :], per_rank[0][INTERMEDIATE // tp :])
            for ids in per_rank
        )


def test_ssm_head_ids_are_sharded_in_rank_order():
    assert ssm_head_ids(8, 4, 2).tolist() == [4, 5]
    with pytest.raises(ValueError):
        ssm_head_ids(6, 4, 0)


@pytest.mark.parametrize(
    "bad",
    [
        dict(tp_rank=2),
        dict(tp_rank=-1),
        dict(tp_size=3),  # does not divide num_heads
        dict(n_groups=2, tp_size=4),  # vLLM asserts: not divisible and not 1
        dict(d_state=0),
        dict(intermediate_size=12),  # num_heads does not divide it
    ],
)
def test_bad_layout_input_raises_value_error(bad):
    args = dict(intermediate_size=16, n_groups=2, d_state=4, num_heads=8, tp_size=2, tp_rank=0)
    args.update(bad)
    tp_size, tp_rank = args.pop("tp_size"), args.pop("tp_rank")
    with pytest.raises(ValueError):
        conv_channel_ids(Mamba2State(**args), tp_size, tp_rank)


def test_bad_tp_pair_raises_value_error():
    with pytest.raises(ValueError, match="divide"):
        conv_read_plan(*shape(1, 4), 2, 3, 0)
    with pytest.raises(ValueError, match="range"):
        conv_read_plan(*shape(1, 4), 2, 1, 1)


# ----------------------------------------------------------------------------
# The correct plan
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(("n_groups", "d_state", "p_tp", "d_tp"), CASES)
def test_plan_delivers_every_decode_channel(n_groups, d_state, p_tp, d_tp):
    for d_rank in range(d_tp):
        received, expected = simulate(conv_read_plan, n_groups, d_state, p_tp, d_tp, d_rank)
        np.testing.assert_array_equal(received, expected, err_msg=f"d_rank {d_rank}")


@pytest.mark.parametrize(("n_groups", "d_state", "p_tp", "d_tp"), CASES)
def test_plan_tiles_the_decode_page_once_and_reads_inside_prefill_components(
    n_groups, d_state, p_tp, d_tp
):
    for d_rank in range(d_tp):
        plan = conv_read_plan(*shape(n_groups, d_state), p_tp, d_tp, d_rank)
        spans = sorted((r.local_offset_bytes, r.size_bytes) for r in plan)
        cursor = 0
        for offset, size in spans:
            assert offset == cursor
            cursor += size
        d_regions = conv_regions(*shape(n_groups, d_state), d_tp, d_rank)
        assert cursor == sum(reg.size_bytes for reg in d_regions.values())
        for r in plan:
            p_reg = conv_regions(*shape(n_groups, d_state), p_tp, r.p_rank)[r.component]
            assert p_reg.page_offset_bytes <= r.remote_offset_bytes
            assert (
                r.remote_offset_bytes + r.size_bytes <= p_reg.page_offset_bytes + p_reg.size_bytes
            )


def test_plan_for_one_group_prefill_tp2_decode_tp1():
    # I=16 -> x 8 ch/P rank; 1 group of 16 states, 6-byte rows: P B at 48, C at 144.
    plan = conv_read_plan(Mamba2State(16, 1, 16, 8), 3, 2, 2, 1, 0)
    assert plan == [
        ReadSlice(0, "x", 0, 0, 48),
        ReadSlice(1, "x", 0, 48, 48),
        ReadSlice(0, "B", 48, 96, 48),  # states 0..7 of group 0 from P0
        ReadSlice(1, "B", 96, 144, 48),  # states 8..15 of group 0 from P1
        ReadSlice(0, "C", 144, 192, 48),
        ReadSlice(1, "C", 192, 240, 48),
    ]
    assert list(plan_by_p_rank(plan)) == [0, 1]


def test_plan_for_one_group_prefill_tp1_decode_tp2():
    # P0 holds x (96 B), B (96 B), C (96 B); D rank 1 wants x's second half, all of B and C.
    assert conv_read_plan(Mamba2State(16, 1, 16, 8), 3, 2, 1, 2, 1) == [
        ReadSlice(0, "x", 48, 0, 48),
        ReadSlice(0, "B", 96, 48, 96),
        ReadSlice(0, "C", 192, 144, 96),
    ]


@pytest.mark.parametrize(("n_groups", "d_state", "p_tp", "d_tp"), CASES)
def test_plan_keeps_vllm_local_splits_unless_a_replicated_region_does_not_divide(
    n_groups, d_state, p_tp, d_tp
):
    k = p_tp // d_tp if p_tp > d_tp else 1
    bc_bytes = conv_regions(*shape(n_groups, d_state), d_tp, 0)["B"].size_bytes
    for d_rank in range(d_tp):
        plan = conv_read_plan(*shape(n_groups, d_state), p_tp, d_tp, d_rank)
        fits = respects_vllm_local_splits(plan, *shape(n_groups, d_state), p_tp, d_tp, d_rank)
        assert fits == (bc_bytes % k == 0)


def test_uneven_local_split_is_still_correct():
    # d_state 3, 6-byte rows: B is 18 bytes on D TP1, not a multiple of P_TP 4.
    received, expected = simulate(conv_read_plan, 1, 3, 4, 1, 0)
    np.testing.assert_array_equal(received, expected)
    plan = conv_read_plan(*shape(1, 3), 4, 1, 0)
    assert not respects_vllm_local_splits(plan, *shape(1, 3), 4, 1, 0)
    assert [r.size_bytes for r in plan if r.component == "B"] == [4, 5, 4, 5]


# ----------------------------------------------------------------------------
# Stock vLLM 0.21.0
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(("n_groups", "d_state", "p_tp", "d_tp"), CASES)
def test_stock_is_wrong_exactly_when_groups_are_replicated_across_a_tp_mismatch(
    n_groups, d_state, p_tp, d_tp
):
    replicated = groups_replicated(n_groups, p_tp) or groups_replicated(n_groups, d_tp)
    broken = replicated and p_tp != d_tp
    x_bytes = conv_regions(*shape(n_groups, d_state), d_tp, 0)["x"].size_bytes
    for d_rank in range(d_tp):
        received, expected = simulate(stock_conv_read_plan, n_groups, d_state, p_tp, d_tp, d_rank)
        np.testing.assert_array_equal(received[:x_bytes], expected[:x_bytes])  # x always right
        assert np.array_equal(received, expected) == (not broken), f"d_rank {d_rank}"


def test_stock_one_group_prefill_tp2_decode_tp1_matches_docs_design_section_4():
    """docs/design.md section 4: B gets the first half of B from each P rank, C the second half."""
    d_state = 16
    received, expected = simulate(stock_conv_read_plan, 1, d_state, 2, 1, 0)
    channels = received[::ROW_BYTES] // ROW_BYTES
    b_start = INTERMEDIATE
    half = d_state // 2
    b_first_half = list(range(b_start, b_start + half))
    b_second_half = list(range(b_start + half, b_start + d_state))
    d_b = channels[INTERMEDIATE : INTERMEDIATE + d_state].tolist()
    d_c = channels[INTERMEDIATE + d_state :].tolist()
    assert d_b == b_first_half + b_first_half
    assert d_c == b_second_half + b_second_half
    assert not np.array_equal(received, expected)


def test_stock_one_group_prefill_tp1_decode_tp2_reads_past_b():
    received, expected = simulate(stock_conv_read_plan, 1, 16, 1, 2, 1)
    assert not np.array_equal(received, expected)
    assert (received == OUT_OF_CONV).any()  # stock's C offset runs past P's conv state


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_ssm_plan_is_correct_and_stock_agrees(p_tp, d_tp):
    head_bytes = 12
    for d_rank in range(d_tp):
        plan = ssm_read_plan(NUM_HEADS, head_bytes, p_tp, d_tp, d_rank)
        assert plan == stock_ssm_read_plan(NUM_HEADS, head_bytes, p_tp, d_tp, d_rank)
        pages = {
            p: byte_labels(ssm_head_ids(NUM_HEADS, p_tp, p), head_bytes)
            for p in source_p_ranks(p_tp, d_tp, d_rank)
        }
        expected = byte_labels(ssm_head_ids(NUM_HEADS, d_tp, d_rank), head_bytes)
        np.testing.assert_array_equal(apply_plan(plan, pages, expected.size), expected)


# ----------------------------------------------------------------------------
# Ties to vLLM
# ----------------------------------------------------------------------------


def test_module_imports_neither_vllm_nor_torch():
    script = textwrap.dedent(
        """
        import sys
        import vllm_nixl_hma.core.mamba_conv
        print("heavy:", sorted(m for m in ("vllm", "torch") if m in sys.modules))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "heavy: []" in out


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_replicated_ids_match_vllms_own_weight_loader(tp):
    """Load a conv weight whose rows are global channel ids with vLLM's loader."""
    # plain imports: every environment this file runs in has vLLM, and a rename
    # must fail these tests, not skip the only ones tied to vLLM's weight loader
    import torch
    from vllm.model_executor.layers.mamba import mamba_mixer2 as mixer

    d_state, n_groups = 4, 1
    groups_ss = padded_n_groups(n_groups, tp) * d_state
    group_settings = (groups_ss, (padded_n_groups(n_groups, tp) - n_groups) * d_state, True)
    spec = [(INTERMEDIATE, 0, False), group_settings, group_settings]
    full = torch.arange(INTERMEDIATE + 2 * n_groups * d_state, dtype=torch.int64)
    for rank in range(tp):
        param = torch.full(((INTERMEDIATE + 2 * groups_ss) // tp,), -1, dtype=torch.int64)
        mixer.mamba_v2_sharded_weight_loader(spec, tp, rank)(param, full)
        ours = conv_channel_ids(mamba2(n_groups, d_state), tp, rank)
        assert param.tolist() == ours.tolist()


@pytest.mark.parametrize(("n_groups", "tp"), [(1, 1), (1, 2), (1, 8), (2, 2), (8, 4)])
def test_local_size_matches_vllms_state_shape(n_groups, tp):
    from vllm.model_executor.layers.mamba import mamba_utils

    d_state = 4
    conv_shape, ssm_shape = mamba_utils.MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=tp,
        intermediate_size=INTERMEDIATE,
        n_groups=n_groups,
        num_heads=NUM_HEADS,
        head_dim=HEAD_DIM,
        state_size=d_state,
        conv_kernel=CONV_ROWS + 1,
    )
    assert tuple(conv_shape) == (
        conv_channel_ids(mamba2(n_groups, d_state), tp, 0).size,
        CONV_ROWS,
    )
    assert ssm_shape[0] == ssm_head_ids(NUM_HEADS, tp, 0).size


# ----------------------------------------------------------------------------
# GatedDeltaNet (Qwen3-Next, Qwen3.5): conv parts q, k, v of unequal sizes
# ----------------------------------------------------------------------------

# key and value sizes differ, as in real models: q and k have 8 heads x 3,
# v has 16 heads x 5; every TP size divides both head counts.
GDN = GatedDeltaNetState(num_k_heads=8, num_v_heads=16, head_k_dim=3, head_v_dim=5)
GDN_KEY_DIM = 8 * 3
GDN_VALUE_DIM = 16 * 5


def gdn_simulation(model, p_tp, d_tp, d_rank, plan_model=None):
    """(received, expected) labels when the plan is computed with ``plan_model``
    (default: the true model) and the pages are laid out as ``model`` says."""
    plan = conv_read_plan(plan_model or model, CONV_ROWS, DTYPE_SIZE, p_tp, d_tp, d_rank)
    pages = {
        p: byte_labels(conv_channel_ids(model, p_tp, p)) for p in source_p_ranks(p_tp, d_tp, d_rank)
    }
    expected = byte_labels(conv_channel_ids(model, d_tp, d_rank))
    return apply_plan(plan, pages, expected.size), expected


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_gdn_plan_delivers_every_decode_channel(p_tp, d_tp):
    for d_rank in range(d_tp):
        received, expected = gdn_simulation(GDN, p_tp, d_tp, d_rank)
        np.testing.assert_array_equal(received, expected, err_msg=f"d_rank {d_rank}")
        plan = conv_read_plan(GDN, CONV_ROWS, DTYPE_SIZE, p_tp, d_tp, d_rank)
        # vLLM's local descriptors carry it: every part divides evenly
        assert respects_vllm_local_splits(plan, GDN, CONV_ROWS, DTYPE_SIZE, p_tp, d_tp, d_rank)


def test_gdn_channel_ids_are_q_then_k_then_v_shards():
    model = GatedDeltaNetState(num_k_heads=2, num_v_heads=2, head_k_dim=1, head_v_dim=3)
    # global: q 0..1, k 2..3, v 4..9; rank r holds its half of each
    assert conv_channel_ids(model, 2, 0).tolist() == [0, 2, 4, 5, 6]
    assert conv_channel_ids(model, 2, 1).tolist() == [1, 3, 7, 8, 9]
    regions = conv_regions(model, CONV_ROWS, DTYPE_SIZE, 2, 1)
    assert [(r.component, r.page_offset_bytes, r.size_bytes) for r in regions.values()] == [
        ("q", 0, ROW_BYTES),
        ("k", ROW_BYTES, ROW_BYTES),
        ("v", 2 * ROW_BYTES, 3 * ROW_BYTES),
    ]


def test_gdn_plan_for_prefill_tp2_decode_tp1():
    model = GatedDeltaNetState(num_k_heads=2, num_v_heads=2, head_k_dim=1, head_v_dim=3)
    r = ROW_BYTES
    # each P rank: q (1 ch) at 0, k (1 ch) at r, v (3 ch) at 2r; D: q 2, k 2, v 6 channels
    assert conv_read_plan(model, CONV_ROWS, DTYPE_SIZE, 2, 1, 0) == [
        ReadSlice(0, "q", 0, 0, r),
        ReadSlice(1, "q", 0, r, r),
        ReadSlice(0, "k", r, 2 * r, r),
        ReadSlice(1, "k", r, 3 * r, r),
        ReadSlice(0, "v", 2 * r, 4 * r, 3 * r),
        ReadSlice(1, "v", 2 * r, 7 * r, 3 * r),
    ]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (4, 2), (2, 8)])
def test_a_split_assuming_equal_qkv_sizes_delivers_wrong_channels(p_tp, d_tp):
    """The oracle's bite: a model whose v is the size of k (as a split of the
    conv dim into equal thirds would assume) puts the wrong bytes in place."""
    equal_thirds = GatedDeltaNetState(
        num_k_heads=GDN.num_k_heads,
        num_v_heads=GDN.num_k_heads,
        head_k_dim=GDN.head_k_dim,
        head_v_dim=GDN.head_k_dim,
    )
    wrong = 0
    for d_rank in range(d_tp):
        plan = conv_read_plan(equal_thirds, CONV_ROWS, DTYPE_SIZE, p_tp, d_tp, d_rank)
        pages = {
            p: byte_labels(conv_channel_ids(GDN, p_tp, p))
            for p in source_p_ranks(p_tp, d_tp, d_rank)
        }
        expected = byte_labels(conv_channel_ids(GDN, d_tp, d_rank))
        wrong += int(np.count_nonzero(apply_plan(plan, pages, expected.size) != expected))
    assert wrong > 0


@pytest.mark.parametrize(
    "bad",
    [
        dict(num_k_heads=3),  # TP 2 does not divide the key heads
        dict(num_v_heads=6, num_k_heads=2, tp=4),  # nor 4 the value heads
        dict(head_v_dim=0),
    ],
)
def test_gdn_refuses_what_vllm_cannot_shard(bad):
    tp = bad.pop("tp", 2)
    fields = dict(num_k_heads=2, num_v_heads=4, head_k_dim=3, head_v_dim=5)
    fields.update(bad)
    with pytest.raises(ValueError):
        conv_channel_ids(GatedDeltaNetState(**fields), tp, 0)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_gdn_ids_match_vllms_own_weight_loader(tp):
    """GatedDeltaNetAttention.__init__ loads conv1d with mamba_v2_sharded_weight_loader
    and the shard spec [(key_dim, 0, False), (key_dim, 0, False), (value_dim, 0, False)]
    (gdn_linear_attn.py 344-356): load a weight whose rows are global channel ids."""
    # plain imports: every environment this file runs in has vLLM, and a rename
    # must fail these tests, not skip the only ones tied to vLLM's weight loader
    import torch
    from vllm.model_executor.layers.mamba import mamba_mixer2 as mixer

    spec = [(GDN_KEY_DIM, 0, False), (GDN_KEY_DIM, 0, False), (GDN_VALUE_DIM, 0, False)]
    full = torch.arange(2 * GDN_KEY_DIM + GDN_VALUE_DIM, dtype=torch.int64)
    for rank in range(tp):
        param = torch.full(((2 * GDN_KEY_DIM + GDN_VALUE_DIM) // tp,), -1, dtype=torch.int64)
        mixer.mamba_v2_sharded_weight_loader(spec, tp, rank)(param, full)
        assert param.tolist() == conv_channel_ids(GDN, tp, rank).tolist()


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_gdn_local_sizes_match_vllms_state_shape(tp):
    from vllm.model_executor.layers.mamba import mamba_utils

    conv_shape, state_shape = mamba_utils.MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp, GDN.num_k_heads, GDN.num_v_heads, GDN.head_k_dim, GDN.head_v_dim, CONV_ROWS + 1
    )
    assert tuple(conv_shape) == (conv_channel_ids(GDN, tp, 0).size, CONV_ROWS)
    assert tuple(state_shape) == (
        ssm_head_ids(GDN.state_heads, tp, 0).size,
        GDN.head_v_dim,
        GDN.head_k_dim,
    )


def test_state_model_of_reads_each_layer_type_from_its_config_fields():
    from types import SimpleNamespace

    from vllm_nixl_hma.core.mamba_conv import state_model_of

    qwen3_next = SimpleNamespace(
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    )
    bamba = SimpleNamespace(
        mamba_n_heads=16, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, hidden_size=8
    )
    assert state_model_of(qwen3_next, "GDN_ATTN") == GatedDeltaNetState(16, 32, 128, 128)
    assert state_model_of(bamba, "MAMBA2") == Mamba2State(256, 2, 16, 16)
    assert state_model_of(bamba, "GDN_ATTN") is None
    assert state_model_of(qwen3_next, "MAMBA1") is None
