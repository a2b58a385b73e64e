"""The embedded model shapes the check runs on, and Mamba parameters of HF configs.

Synthetic ``config.json`` contents (no weights, no downloads), small enough
for a 2-core machine yet shaped like the real families where it matters:
one KV head (replicated across TP ranks) and Mamba state sharded by TP, so
that prefill and decode with different TP get different kernel-per-logical
ratios, as Qwen3.5 and Nemotron-H do at real sizes.
"""

from __future__ import annotations

from typing import Any

_COMMON = {
    "vocab_size": 256,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

#: layout name -> HF config.json content
LAYOUTS: dict[str, dict[str, Any]] = {
    # Full attention only, KV heads split across TP ranks.
    "dense": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
    # Attention + Mamba2 (Bamba), 2 SSM groups, 1 KV head: the Mamba page
    # per rank halves with each doubling of TP, the attention page does not.
    # Kernel block 16 and ratio 5 at TP 1, 3 at TP 2 (1 with kernel 32 at TP 4).
    "hybrid": {
        **_COMMON,
        "architectures": ["BambaForCausalLM"],
        "model_type": "bamba",
        "hidden_size": 128,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "attn_layer_indices": [1, 3],
        "mamba_n_heads": 16,
        "mamba_d_head": 16,
        "mamba_n_groups": 2,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 64,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
    },
}
# Full attention + sliding window: two HMA groups sharing pages.
LAYOUTS["swa"] = {
    **LAYOUTS["dense"],
    "sliding_window": 40,
    "layer_types": ["sliding_attention", "full_attention"],
}
# Mistral-like: every layer attends over a sliding window, no full-attention
# layer; vLLM runs it as one sliding-window group (issue #41). The window is
# shorter than a logical block (16 tokens; 32 on vLLM 0.33), ``swa``'s is
# longer; ``window_layout`` gives others.
LAYOUTS["swa-only"] = {
    **LAYOUTS["dense"],
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention"],
}


def window_layout(name: str, window_tokens: int) -> dict[str, Any]:
    """Layout ``name`` (one with a sliding window) with another window."""
    layout = dict(LAYOUTS[name])
    if "sliding_window" not in layout:
        raise ValueError(f"layout {name!r} has no sliding window")
    layout["sliding_window"] = window_tokens
    return layout


# granite-4.0-h-like: one SSM group, replicated on every rank when TP > 1
# (docs/design.md section 4). Kernel block 16; ratio 9 at TP 1, 5 at TP 2, 3 at TP 4.
LAYOUTS["hybrid-1group"] = {**LAYOUTS["hybrid"], "mamba_n_groups": 1, "mamba_d_state": 32}
# Qwen3-Next-shaped: full attention + GatedDeltaNet linear attention, 1 KV
# head, q/k of 2 heads x 16 and v of 8 heads x 32 (unequal, as in real
# models), recurrent state (8 // tp, 32, 16). Kernel block 16; ratio 5 at TP 1,
# 3 at TP 2. vLLM's Qwen3-Next needs one MoE layer (layer 0 here).
LAYOUTS["gdn"] = {
    **_COMMON,
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "full_attention_interval": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1, 2, 3],
    "norm_topk_prob": True,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000.0,
}


def as_granite_hybrid(bamba: dict[str, Any]) -> dict[str, Any]:
    """The same Mamba2 hybrid as a ``GraniteMoeHybridForCausalLM`` (granite-4.0-h) config.

    vLLM removed Bamba in 0.23.0; granite-4.0-h is the Mamba2 hybrid it keeps
    (no MoE: ``num_local_experts`` 0, one shared MLP; no position embedding).
    Layer order, Mamba shapes and the attention heads are ``bamba``'s.
    """
    attention_layers = set(bamba["attn_layer_indices"])
    config = {k: v for k, v in bamba.items() if k != "attn_layer_indices"}
    config.update(
        architectures=["GraniteMoeHybridForCausalLM"],
        model_type="granitemoehybrid",
        layer_types=[
            "full_attention" if index in attention_layers else "linear_attention"
            for index in range(bamba["num_hidden_layers"])
        ],
        num_local_experts=0,
        shared_intermediate_size=bamba["intermediate_size"],
        position_embedding_type="nope",
        embedding_multiplier=1.0,
        logits_scaling=1.0,
        residual_multiplier=1.0,
        attention_multiplier=1.0,
        attention_bias=False,
    )
    return config


#: vLLM 0.33: the same layouts, the Mamba2 hybrids as granite-4.0-h configs
LAYOUTS_V033: dict[str, dict[str, Any]] = {
    name: as_granite_hybrid(config) if config["model_type"] == "bamba" else config
    for name, config in LAYOUTS.items()
}


def installed_layouts() -> dict[str, dict[str, Any]]:
    """The embedded layouts for the installed vLLM (``_compat.adapter``)."""
    from vllm_nixl_hma import _compat

    return LAYOUTS_V033 if _compat.builds_on("v033") else LAYOUTS
