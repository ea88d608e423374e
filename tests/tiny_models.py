"""Tiny random checkpoints saved by `transformers`, with a byte-level BPE tokenizer.

`index_topk` is small so prompts longer than it run the sparse path; 8 indexer heads by default
so exact score ties (ReLU zeros) stay rare, as in real models (the tie-break tests use 1-2).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
    PreTrainedTokenizerFast,
)

VOCAB = 384
EOS = "<|endoftext|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = % ?",
    "What is 15% of 240? It is 36. Hello world! Bonjour le monde. Hola mundo.",
    "def f(x):\n    return x * 2  # comment\n",
    "Paris, London, Tokyo, Berlin: the weather is sunny, rainy or cloudy today.",
]

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
    kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
    n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
    index_topk=8, index_head_dim=32, index_n_heads=8, max_position_embeddings=4096,
)  # fmt: skip


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def make_checkpoint(
    folder: Path, kind: str = "glm", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> Path:
    """Save a random model of `kind` ("glm" or "deepseek") with a tokenizer into `folder`."""
    torch.manual_seed(seed)
    if kind == "glm":
        rope = {"rope_theta": 1000000.0, "rope_type": "default"}
        config = GlmMoeDsaConfig(**{**COMMON, "rope_parameters": rope, **overrides})
        model = GlmMoeDsaForCausalLM(config)
    else:
        rope = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 40.0, "beta_fast": 32,
                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 128}  # fmt: skip
        args = {**COMMON, "n_group": 4, "topk_group": 2, "max_position_embeddings": 5120}
        config = DeepseekV32Config(**{**args, "rope_parameters": rope, **overrides})
        model = DeepseekV32ForCausalLM(config)
    _randomise_moe(model)
    model.to(dtype).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(folder)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    return folder


def _randomise_moe(model: torch.nn.Module) -> None:
    """transformers initialises the router bias to zero and experts tiny: make routing matter."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.1)
            if hasattr(module, "gate_up_proj"):
                module.gate_up_proj.normal_(0, 0.05)
                module.down_proj.normal_(0, 0.05)


def load_reference(folder: Path):
    """The transformers model for a checkpoint folder, fp32, eval mode."""
    config = json.loads((folder / "config.json").read_text())
    cls = GlmMoeDsaForCausalLM if config["model_type"] == "glm_moe_dsa" else DeepseekV32ForCausalLM
    return cls.from_pretrained(folder, dtype=torch.float32).eval()
