"""Tiny models with real weights, made offline and cached (transformers, fixed seed).

``hybrid``: Qwen3-Next (GatedDeltaNet linear attention + full attention), one KV
head (replicated at TP 2 while the GatedDeltaNet state is sharded, so the logical
block size differs between TP 1 and TP 2), key and value parts of different sizes.
``dense``: Llama; ``swa``: the same Llama with its first layer attending
over a sliding window of 64 tokens (``layer_types``, which vLLM's Llama reads;
transformers' ignores it, so the weights are a plain Llama's); ``swa-only``
and ``swa-only-8``: every layer over a window of 256 or 8 tokens. All float32,
with ``lm_head`` drawn wider than the rest so that greedy choices are rarely
near-ties, and a word-level tokenizer over the vocabulary
(prompts are sent as token ids). vLLM's Qwen3-Next needs one MoE layer (layer 0).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["MODELS", "VOCAB_SIZE", "ensure_model"]

VOCAB_SIZE = 512
SEED = 0
LM_HEAD_STD = 0.2

_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: name -> (transformers config class, model class, config fields)
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "hybrid": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            **_COMMON,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "layer_types": [
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            "full_attention_interval": 2,
            # the recurrent state (4 // tp, 64, 64) float32 is 64 KiB per rank at TP 1:
            # attention pages of 256 tokens at TP 1 and 128 at TP 2 hold it
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1, 2, 3],
            "norm_topk_prob": True,
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000.0,
        },
    ),
    "dense": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            **_COMMON,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
        },
    ),
}
MODELS["swa"] = (
    "LlamaConfig",
    "LlamaForCausalLM",
    {
        **MODELS["dense"][2],
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"],
    },
)
# Mistral-shaped (issue #41): every layer attends over a sliding window, of
# 256 tokens (shorter than the fault prompts, longer than a logical block) or
# of 8 (shorter than a kernel block); vLLM runs either as one sliding-window
# KV cache group
for _name, _window in (("swa-only", 256), ("swa-only-8", 8)):
    MODELS[_name] = (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            **MODELS["dense"][2],
            "sliding_window": _window,
            "layer_types": ["sliding_attention", "sliding_attention"],
        },
    )


def default_cache_dir() -> Path:
    base = os.environ.get("VLLM_NIXL_HMA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm_nixl_hma"
    )
    return Path(base) / "models"


def _key(name: str) -> str:
    import transformers

    config_cls, model_cls, fields = MODELS[name]
    text = json.dumps([config_cls, model_cls, fields, SEED, LM_HEAD_STD, transformers.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def ensure_model(name: str, cache_dir: Path | None = None) -> Path:
    """The directory of model ``name``, made once per content and reused after."""
    if name not in MODELS:
        raise ValueError(f"no embedded model {name!r}; choose one of {', '.join(MODELS)}")
    cache_dir = cache_dir or default_cache_dir()
    target = cache_dir / f"{name}-{_key(name)}"
    if (target / "model.safetensors").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    try:
        _make(name, staging)
        try:
            staging.rename(target)
        except OSError:  # another process made it first
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _make(name: str, directory: Path) -> None:
    import torch
    import transformers

    config_cls, model_cls, fields = MODELS[name]
    config = getattr(transformers, config_cls)(**fields)
    torch.manual_seed(SEED)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, LM_HEAD_STD)
    model.save_pretrained(directory, safe_serialization=True)
    word_tokenizer().save_pretrained(directory)


def word_tokenizer():
    """The tiny models' tokenizer: one token per word (``w3``, ``w4``, ...).
    Also the stand-in tokenizer of vLLM's own suite (tests/upstream)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB_SIZE)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
