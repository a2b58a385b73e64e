"""``worker.derive_state_split``: the worker's description of a Mamba-type state,
checked against the shapes vLLM's layer reports, before any NIXL registration."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402

from vllm_nixl_hma.core.errors import UnsupportedModelError  # noqa: E402
from vllm_nixl_hma.v021.worker import derive_state_split  # noqa: E402

# Qwen3-Next-like: q, k of 2 heads x 16, v of 8 heads x 32; conv kernel 4
GDN_CONFIG = SimpleNamespace(
    linear_num_key_heads=2,
    linear_num_value_heads=8,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
)


def vllm_config(hf_config, arch="Qwen3NextForCausalLM"):
    return SimpleNamespace(
        model_config=SimpleNamespace(
            architecture=arch, hf_config=hf_config, hf_text_config=hf_config
        )
    )


def gdn_spec(tp: int, mamba_type=MambaAttentionBackendEnum.GDN_ATTN) -> MambaSpec:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(tp, 2, 8, 16, 32, 4)
    return MambaSpec(
        shapes=tuple(tuple(s) for s in shapes),
        dtypes=(torch.bfloat16, torch.float32),
        block_size=1024,
        mamba_type=mamba_type,
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_gated_delta_net_parts_are_q_k_v_with_v_larger(tp):
    split = derive_state_split(vllm_config(GDN_CONFIG), gdn_spec(tp), tp, 0)
    row_bytes = 3 * 2  # conv kernel - 1 rows of bf16
    q = k = 32 // tp * row_bytes
    v = 256 // tp * row_bytes
    assert split.local_conv_offsets == [(0, q), (q, k), (q + k, v)]
    assert split.ssm_head_bytes == 32 * 16 * 4  # (head_v_dim, head_k_dim) of float32
    assert split.ssm_sizes == (q + k + v, 8 // tp * split.ssm_head_bytes)


def test_a_config_that_does_not_give_the_layers_shapes_is_refused():
    wrong = SimpleNamespace(**{**vars(GDN_CONFIG), "linear_value_head_dim": 16})
    with pytest.raises(UnsupportedModelError, match="160 and 4"):
        derive_state_split(vllm_config(wrong), gdn_spec(2), 2, 0)


def test_a_state_type_it_does_not_describe_is_refused_by_name():
    spec = gdn_spec(1, mamba_type=MambaAttentionBackendEnum.MAMBA1)
    with pytest.raises(UnsupportedModelError, match="MambaForCausalLM has MAMBA1 layers"):
        derive_state_split(vllm_config(GDN_CONFIG, "MambaForCausalLM"), spec, 1, 0)
