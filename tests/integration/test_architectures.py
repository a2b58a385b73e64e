"""The check's layouts come from vLLM's own layers, for every architecture family.

Each fixture under tests/fixtures/architectures is a small config.json (no
weights) of one architecture; the layout is built the way a rank of
``vllm-nixl-hma check --model-config DIR`` builds it (the model on the meta
device, each layer reporting its own KV cache spec), here at TP 1 in this
process. The expected layers are read off each config by hand (which layer
indices are attention and which are Mamba-type), not from the code under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_nixl_hma.harness import layout

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

# fixture -> (attention layer indices, number of Mamba-type layers, mamba_type,
#             conv channels and state heads of a Mamba-type layer at TP 1)
# Channels, by hand from each config.json: Mamba2 conv holds x (the SSM's inner
# size: heads x head dim, or mamba_d_ssm) then B and C (n_groups x d_state each);
# GatedDeltaNet conv holds q and k (key heads x key head dim each) then v (value
# heads x value head dim). Heads: Mamba2's SSM heads, GatedDeltaNet's value heads.
EXPECTED = {
    "llama": ([0, 1], 0, None, None),
    "qwen2": ([0, 1], 0, None, None),
    "qwen3": ([0, 1], 0, None, None),
    "mistral": ([0, 1], 0, None, None),
    # attn_layer_indices [1, 3]; 16 heads x 16 + 2 x (2 groups x 16)
    "bamba": ([1, 3], 2, "MAMBA2", (256 + 2 * 2 * 16, 16)),
    # layer_types; 16 x 16 + 2 x (1 group x 32)
    "granitemoehybrid": ([1, 3], 2, "MAMBA2", (256 + 2 * 1 * 32, 16)),
    # hybrid_override_pattern "M*M-"; 16 x 16 + 2 x (2 x 16)
    "nemotron_h": ([1], 2, "MAMBA2", (256 + 2 * 2 * 16, 16)),
    # attention and Mamba2 side by side in both layers; mamba_d_ssm 256 + 2 x (2 x 16)
    "falcon_h1": ([0, 1], 2, "MAMBA2", (256 + 2 * 2 * 16, 16)),
    # layer_types linear/full alternating; 2 x (2 key heads x 16) + 8 value heads x 32
    "qwen3_next": ([1, 3], 2, "GDN_ATTN", (2 * 2 * 16 + 8 * 32, 8)),
}


def _layout(model_dir: Path):
    vllm_config = layout.build_vllm_config(
        str(model_dir), 1, "NixlHMAConnector", "engine", "kv_both", 64, 512
    )
    with layout.single_process_tp_group(vllm_config):
        return layout.build_engine_layout(vllm_config, 0)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_layers_and_kinds_come_from_the_model(name):
    attention_layers, num_mamba_layers, mamba_type, state_rows = EXPECTED[name]
    built = _layout(FIXTURES / "architectures" / name)
    assert [view.layer_index for view in built.attention] == attention_layers
    assert len(built.mamba) == num_mamba_layers
    groups = built.kv_cache_config.kv_cache_groups
    for view in built.mamba:
        assert groups[view.group_index].kv_cache_spec.mamba_type.name == mamba_type
    for view in built.mamba:  # TP 1: every channel and head the config has, in order
        channels, heads = state_rows
        assert view.conv.shape[1] == channels and view.ssm.shape[1] == heads
        assert view.conv_channel_ids.tolist() == list(range(channels))
        assert view.ssm_head_ids.tolist() == list(range(heads))
        # (which rows a rank holds at TP 2 and more: tests/unit/test_mamba_conv.py,
        # against vLLM's weight loader, and the oracle cells of test_pd_oracle.py)
    for view in built.attention:
        assert view.layer_name in groups[view.group_index].layer_names
    layout.verify_layout(built)  # the views alias the runner's buffers as vLLM intends


def test_a_state_the_connector_cannot_move_is_refused_in_one_line():
    with pytest.raises(layout.UnsupportedArchitecture) as refusal:
        _layout(FIXTURES / "unsupported" / "mamba1")
    message = str(refusal.value)
    assert "\n" not in message
    assert "MambaForCausalLM" in message and "MAMBA1" in message
