"""A tiny random DeepseekV32ForCausalLM with a DeepSeek-V3.2-style tokenizer and no chat template.

The tokenizer is a small byte-level BPE with DeepSeek's markers as added tokens, spelled and
flagged as in the real checkpoint: `<｜begin▁of▁sentence｜>` and `<｜end▁of▁sentence｜>` special,
`<｜User｜>`, `<｜Assistant｜>`, `<think>`, `</think>` and the DSML marker `｜DSML｜` plain added
tokens (so they survive decoding). With no `chat_template.jinja`, dsaserve renders prompts with
its built-in DeepSeek-V3.2 encoder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_models import COMMON, CORPUS
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, PreTrainedTokenizerFast

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
MARKERS = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜"]
DSML_TEXT = (
    '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter '
    'name="location" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    "</｜DSML｜function_calls>"
)


def build_deepseek_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator([*CORPUS, DSML_TEXT] * 4, trainer)
    tok.add_tokens([AddedToken(m, normalized=False, special=False) for m in MARKERS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=EOS)  # fmt: skip


def make_deepseek_server_checkpoint(folder: Path, context_length: int = 1024) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_deepseek_tokenizer()
    tokenizer.save_pretrained(folder)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    torch.manual_seed(0)
    rope = {"rope_theta": 10000.0, "rope_type": "default"}
    config = DeepseekV32Config(**{
        **COMMON, "vocab_size": len(tokenizer), "num_hidden_layers": 2, "n_group": 4,
        "topk_group": 2, "max_position_embeddings": context_length, "rope_parameters": rope,
        "eos_token_id": eos, "bos_token_id": tokenizer.convert_tokens_to_ids(BOS),
    })  # fmt: skip
    DeepseekV32ForCausalLM(config).eval().save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    return folder
