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

# fixture -> (attention layer indices, number of Mamba-type layers, mamba_type)
EXPECTED = {
    "llama": ([0, 1], 0, None),
    "qwen2": ([0, 1], 0, None),
    "qwen3": ([0, 1], 0, None),
    "mistral": ([0, 1], 0, None),
    "bamba": ([1, 3], 2, "MAMBA2"),  # attn_layer_indices [1, 3]
    "granitemoehybrid": ([1, 3], 2, "MAMBA2"),  # layer_types
    "nemotron_h": ([1], 2, "MAMBA2"),  # hybrid_override_pattern "M*M-"
    "falcon_h1": ([0, 1], 2, "MAMBA2"),  # attention and Mamba2 side by side in both layers
    "qwen3_next": ([1, 3], 2, "GDN_ATTN"),  # layer_types linear/full alternating
}


def _layout(model_dir: Path):
    vllm_config = layout.build_vllm_config(
        str(model_dir), 1, "NixlHMAConnector", "engine", "kv_both", 64, 512
    )
    with layout.single_process_tp_group(vllm_config):
        return layout.build_engine_layout(vllm_config, 0)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_layers_and_kinds_come_from_the_model(name):
    attention_layers, num_mamba_layers, mamba_type = EXPECTED[name]
    built = _layout(FIXTURES / "architectures" / name)
    assert [view.layer_index for view in built.attention] == attention_layers
    assert len(built.mamba) == num_mamba_layers
    groups = built.kv_cache_config.kv_cache_groups
    for view in built.mamba:
        assert groups[view.group_index].kv_cache_spec.mamba_type.name == mamba_type
    for view in built.mamba:  # TP 1: every channel and head, in checkpoint order
        assert view.conv_channel_ids.tolist() == list(range(view.conv.shape[1]))
        assert view.ssm_head_ids.tolist() == list(range(view.ssm.shape[1]))
    for view in built.attention:
        assert view.layer_name in groups[view.group_index].layer_names
    layout.verify_layout(built)  # the views alias the runner's buffers as vLLM intends


def test_a_state_the_connector_cannot_move_is_refused_in_one_line():
    with pytest.raises(layout.UnsupportedArchitecture) as refusal:
        _layout(FIXTURES / "unsupported" / "mamba1")
    message = str(refusal.value)
    assert "\n" not in message
    assert "MambaForCausalLM" in message and "MAMBA1" in message
