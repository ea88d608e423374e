"""Train the default model's byte-level BPE tokenizer and save it with the chat template.

Digits are always single tokens (so arithmetic is learnable) and GLM's markers are added special
tokens. Run: `python scripts/default_model_tokenizer.py --out dsaserve/assets/default_model`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_model_data import Sample, samples, stop_marker  # noqa: E402

SPECIAL_TOKENS = [
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<tool_response>", "</tool_response>", "/nothink",
]  # fmt: skip
MODEL_DIR = Path(__file__).resolve().parents[1] / "dsaserve/assets/default_model"
TEMPLATE_PATH = MODEL_DIR / "chat_template.jinja"


def chat_template() -> str:
    return TEMPLATE_PATH.read_text()


def render(sample: Sample, add_stop: bool = True) -> str:
    """The full training text of a sample, ending with the marker the model stops on."""
    text = render_jinja_template(
        [sample.messages], tools=sample.tools, chat_template=chat_template(), **sample.kwargs
    )[0][0]
    return text + (stop_marker(sample) if add_stop else "")


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build(out: Path, seed: int = 0, vocab_size: int = 3072, count: int = 6000) -> None:
    texts = [render(s) for s in samples(seed + 101, "train", count)]
    tok = train_tokenizer(texts, vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
        model_max_length=65536,
    )
    fast.chat_template = chat_template()
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=TEMPLATE_PATH.parent)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=3072)
    args = parser.parse_args()
    build(args.out, args.seed, args.vocab_size)


if __name__ == "__main__":
    main()
