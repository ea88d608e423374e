"""Fine-tune the default model on answers asked for in JSON (run J), keeping what it does.

Each step trains on one batch of `--json-rows` JSON conversations (kind "json" of
`default_model_data`: percentage and multiplication questions asked for in JSON, thinking on
and off) plus one batch of `--replay-rows` conversations of the original short kinds (the same
questions in prose, greetings), so the model learns to answer in JSON when asked and only then.
Every main weight is trained (AdamW, cosine schedule); the MTP layer is copied unchanged from
--init-from. A length-bucketed mix (train_default_model.py --kind-weights json=N) puts the
short JSON rows into a few batches and learned them far more slowly on this budget. Run:
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
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, GlmMoeDsaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_model_batches import collate, encode  # noqa: E402
from default_model_data import samples  # noqa: E402
from default_model_tokenizer import MODEL_DIR  # noqa: E402
from train_default_model import RouterBalance, lm_loss, lr_at, model_config  # noqa: E402

REPLAY_KINDS = {"pct": 6, "mul": 2, "greet": 2, "weather": 0, "time": 0, "search": 0,
                "nowtool": 0}  # fmt: skip


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
    parser.add_argument("--json-rows", type=int, default=6)
    parser.add_argument("--replay-rows", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    pad = tokenizer.pad_token_id
    only_json = {kind: 0 for kind in REPLAY_KINDS} | {"json": 1}
    json_pool = [encode(s, tokenizer) for s in samples(args.seed, "train", 1500, only_json)]
    replay = [encode(s, tokenizer) for s in samples(args.seed + 1, "train", 1500, REPLAY_KINDS)]
    config = model_config(tokenizer, 12)
    config._attn_implementation = "eager"
    model = GlmMoeDsaForCausalLM(config)
    state = load_file(args.init_from / "model.safetensors")
    prefix = f"model.layers.{config.num_hidden_layers}."
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith(prefix)})
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
                      draw(replay, args.replay_rows, rng, pad)):  # fmt: skip
            out = fast.forward(model, batch.input_ids, batch.attention_mask, True, 2)
            loss = lm_loss(model.lm_head, out.hidden, batch.input_ids, batch.loss_mask)
            (loss + out.kl).backward()
            losses.append(round(loss.item(), 4))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        balance.step()
        record = {"stage": "json", "step": step, "lm_json": losses[0], "lm_replay": losses[1],
                  "elapsed_s": round(time.time() - start, 1)}  # fmt: skip
        print(json.dumps(record), flush=True)
        log.write(json.dumps(record) + "\n")
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    tensors |= {k: v for k, v in state.items() if k.startswith(prefix)}  # the MTP layer as it was
    tensors = {k: v.bfloat16() if v.dim() >= 2 else v for k, v in tensors.items()}
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
