"""Fine-tune the default model on answers asked for in JSON (run J), keeping what it does.

Each step trains on `--json-rows` JSON conversations (kind "json" of `default_model_data`:
percentage and multiplication questions asked for in JSON, thinking on and off), `--plain-rows`
bare questions answered in JSON as a `response_format` grammar forces it (kind "json_plain",
the grammar-forced first content token not trained), and `--replay-rows` conversations of the
original kinds (prose answers, greetings, tool cycles). Replay rows are distilled from the
frozen starting model (KL of the student's next-token distribution to the teacher's, on every
trained token, plus the usual cross-entropy): plain replay at this size still broke the
arithmetic ("15% is 1 × 12"); distillation keeps the prose behaviour where it was and lets the
JSON rows change only what JSON needs. Every main weight is trained (AdamW, cosine schedule);
the MTP layer is copied unchanged from --init-from. Run:
  python scripts/finetune_default_model_json.py --init-from dsaserve/assets/default_model \
      --out dsaserve/assets/default_model
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import default_model_fast as fast
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, GlmMoeDsaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_model_batches import Example, collate, encode  # noqa: E402
from default_model_data import samples  # noqa: E402
from default_model_tokenizer import MODEL_DIR  # noqa: E402
from train_default_model import RouterBalance, lm_loss, lr_at, model_config  # noqa: E402

REPLAY_KINDS = {"pct": 8, "mul": 2, "greet": 2, "weather": 3, "time": 1, "search": 3,
                "nowtool": 1}  # fmt: skip
THINK_END = "</think>"


def unforce_first_content(example: Example, think_end: int) -> Example:
    """Drop the loss on the answer's first token (the grammar writes `{`, not the model)."""
    loss = list(example.loss)
    ends = [i for i, tok in enumerate(example.ids) if tok == think_end and loss[i]]
    first = ends[-1] + 1 if ends else loss.index(1)
    loss[first] = 0
    return Example(example.ids, loss)


def trained_logits(lm_head, hidden: torch.Tensor, batch) -> torch.Tensor:
    """Logits at the positions that predict a trained token (lm_loss's positions), fp32."""
    chosen = batch.loss_mask[:, 1:].bool()
    return lm_head(hidden[:, : chosen.shape[1]][chosen]).float()


def replay_losses(logits, teacher_logits, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE of the trained tokens, KL(teacher || student)) from the student's logits there."""
    targets = batch.input_ids[:, 1:][batch.loss_mask[:, 1:].bool()]
    kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher_logits, -1), log_target=True,
                  reduction="batchmean")  # fmt: skip
    return F.cross_entropy(logits, targets), kl


def draw(pool: list, rows: int, rng: random.Random, pad: int):
    return collate(rng.sample(pool, rows), pad)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--init-from", type=Path, default=MODEL_DIR)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json-rows", type=int, default=4)
    parser.add_argument("--plain-rows", type=int, default=4)
    parser.add_argument("--replay-rows", type=int, default=8)
    parser.add_argument("--distill", type=float, default=1.0, help="weight of the replay KL")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    pad = tokenizer.pad_token_id
    only = lambda kind: {k: 0 for k in REPLAY_KINDS} | {kind: 1}  # noqa: E731
    json_pool = [encode(s, tokenizer) for s in samples(args.seed, "train", 1500, only("json"))]
    think_end = tokenizer.convert_tokens_to_ids(THINK_END)
    plain_pool = [unforce_first_content(encode(s, tokenizer), think_end)
                  for s in samples(args.seed + 2, "train", 1500, only("json_plain"))]  # fmt: skip
    replay = [encode(s, tokenizer) for s in samples(args.seed + 1, "train", 1500, REPLAY_KINDS)]
    config = model_config(tokenizer, 12)
    config._attn_implementation = "eager"
    model = GlmMoeDsaForCausalLM(config)
    state = load_file(args.init_from / "model.safetensors")
    prefix = f"model.layers.{config.num_hidden_layers}."
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith(prefix)})
    teacher = GlmMoeDsaForCausalLM(config)
    teacher.load_state_dict(model.state_dict())
    teacher.eval().requires_grad_(False)
    balance = RouterBalance(model, rate=1e-3)
    params = list(model.parameters())
    optim = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "train_log.jsonl").open("w")
    start = time.time()
    model.train()
    for step in range(args.steps):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        optim.zero_grad(set_to_none=True)
        losses = []
        for batch in (draw(json_pool, args.json_rows, rng, pad),
                      draw(plain_pool, args.plain_rows, rng, pad)):  # fmt: skip
            out = fast.forward(model, batch.input_ids, batch.attention_mask, True, 2)
            loss = lm_loss(model.lm_head, out.hidden, batch.input_ids, batch.loss_mask)
            (loss + out.kl).backward()
            losses.append(round(loss.item(), 4))
        batch = draw(replay, args.replay_rows, rng, pad)
        with torch.no_grad():
            hidden = fast.forward(teacher, batch.input_ids, batch.attention_mask, True).hidden
            target = trained_logits(teacher.lm_head, hidden, batch)
        out = fast.forward(model, batch.input_ids, batch.attention_mask, True, 2)
        loss, kl = replay_losses(trained_logits(model.lm_head, out.hidden, batch), target, batch)
        (loss + args.distill * kl + out.kl).backward()
        losses += [round(loss.item(), 4), round(kl.item(), 5)]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        balance.step()
        record = {"stage": "json", "step": step, "lm_json": losses[0], "lm_plain": losses[1],
                  "lm_replay": losses[2], "kl_replay": losses[3],
                  "elapsed_s": round(time.time() - start, 1)}  # fmt: skip
        print(json.dumps(record), flush=True)
        log.write(json.dumps(record) + "\n")
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    tensors |= {k: v for k, v in state.items() if k.startswith(prefix)}  # the MTP layer as it was
    tensors = {k: v.bfloat16() if v.dim() >= 2 else v for k, v in tensors.items()}
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
