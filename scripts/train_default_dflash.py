"""Train the embedded model's DFlash2 drafter (block size 8) on the target's own hidden states.

    python scripts/train_default_dflash.py --out dsaserve/assets/default_dflash

Seeded and CPU-sized: 600 conversations, 500 steps; on a 2-core machine shared with other jobs
(load 15-20) the data took 31 minutes and the training 52; on idle cores both take a fraction of
that (one torch thread per process is fastest when cores are shared). The target
(`dsaserve/assets/default_model`)
is frozen: one forward per conversation gives the drafter's context (its hidden states at
`--taps`) and the labels, the target's own greedy continuation after each anchor
(`default_dflash_data.py`). Each step draws sequences and anchors in them; a block is
[anchor token, [MASK] x 7] at the anchor's positions, attending non-causally over the context
before the anchor and over itself, through the package's own drafter module
(`dsaserve/models/dflash.py`), so the weights it writes are the served ones by construction.
Loss: cross-entropy of each block row's logits against its label, weighted exp(-(j-1)/gamma)
for draft position j (DFlash's decay: a later token only counts when all before it are
accepted), plus the selector's cross-entropy over its top-k candidates with the previous label
as predecessor (teacher forcing). Every `--eval-every` steps it reports, on held-out
conversations, the mean greedy accept length over every anchor (tokens a verify step would
emit: accepted drafts + 1). Output: config.json (the reference's DFlash2 format) and
model.safetensors (matrices in bf16) in --out (only what the server loads); the training log
in --log (docs/default_dflash/, beside the drafter's card, not in the package).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, GlmMoeDsaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_dflash_data import IGNORE, Example, build  # noqa: E402
from default_model_tokenizer import MODEL_DIR  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dsaserve.models.dflash import DFlashDraftModel  # noqa: E402
from dsaserve.models.dflash_config import DFlashConfig  # noqa: E402

MASK_TOKEN = "[MASK]"
LOG_FILE = Path(__file__).resolve().parents[1] / "docs" / "default_dflash" / "train_log.jsonl"


def drafter_config(args, target: dict, mask_id: int) -> dict:
    """The published DFlash2 config.json layout (z-lab/dflash's dflash2-config.json fixture)."""
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "is_causal": False, "dtype": "float32",
        "dflash_config": {
            "block_size": args.block_size, "target_layer_ids": args.taps,
            "mask_token_id": mask_id, "conv_kernel_size": 2, "conv_group_size": 16,
            "selector_rank": args.selector_rank, "selector_top_k": args.selector_top_k,
            "output_multiplier": 1.0, "final_logit_softcapping": 30.0,
        },
        "head_dim": args.head_dim, "hidden_act": "silu", "hidden_size": target["hidden_size"],
        "initializer_range": 0.02, "intermediate_size": args.intermediate,
        "layer_types": ["full_attention"] * args.layers, "max_position_embeddings": 65536,
        "num_attention_heads": args.heads, "num_hidden_layers": args.layers,
        "num_key_value_heads": args.kv_heads, "num_target_layers": target["num_hidden_layers"],
        "rms_norm_eps": 1e-5, "rope_parameters": dict(target["rope_parameters"]),
        "tie_word_embeddings": False, "use_cache": False, "use_sliding_window": False,
        "vocab_size": target["vocab_size"],
    }  # fmt: skip


def init_weights(model: DFlashDraftModel, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("base_kernel"):
            param.data.zero_()
            param.data[:, 0] = 1.0  # the convolutions start as the identity
        elif name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)


class Batch:
    """Blocks of one step: `anchors` drawn in each sequence (with repeats when it has fewer),
    grouped by sequence, the sequences padded to one width."""

    def __init__(self, examples: list[Example], anchors: int, block: int, mask_id: int,
                 rng: random.Random) -> None:  # fmt: skip
        width = max(e.ids.shape[0] for e in examples)
        self.taps = torch.zeros(len(examples), width, examples[0].taps.shape[1])
        self.lengths = torch.tensor([e.ids.shape[0] for e in examples])
        starts, first, labels = [], [], []
        for s, e in enumerate(examples):
            self.taps[s, : e.ids.shape[0]] = e.taps.float()
            pool = e.anchors.tolist()
            chosen = (
                rng.sample(pool, anchors) if len(pool) >= anchors else rng.choices(pool, k=anchors)
            )
            starts += chosen
            first += e.ids[chosen].tolist()
            labels.append(e.labels[chosen])
        self.anchors = anchors
        self.starts = torch.tensor(starts)  # [R], R = sequences x anchors, sequence-major
        self.positions = self.starts[:, None] + torch.arange(block)[None]  # [R, B]
        self.block_ids = torch.full((len(starts), block), mask_id)
        self.block_ids[:, 0] = torch.tensor(first)
        self.labels = torch.cat(labels)  # [R, B - 1]

    def allowed(self) -> torch.Tensor:
        """[S, A * B, L + A * B]: a block row sees the context before its anchor (inside its
        sequence) and every row of its own block."""
        seqs, width = self.taps.shape[:2]
        rows, block = self.positions.shape
        per_seq = self.anchors * block
        starts = (
            self.starts.view(seqs, self.anchors, 1).expand(-1, -1, block).reshape(seqs, per_seq)
        )
        key = torch.arange(width)[None, None]
        ctx = (key < starts[..., None]) & (key < self.lengths[:, None, None])
        owner = torch.arange(per_seq) // block
        own = (owner[:, None] == owner[None, :])[None].expand(seqs, -1, -1)
        return torch.cat([ctx, own], dim=-1)


def forward(drafter, embed, batch: Batch) -> torch.Tensor:
    """Normed block hidden states [R, B, H] (block rows 1.. predict the labels)."""
    seqs, width, _ = batch.taps.shape
    positions = torch.arange(width)
    entries = drafter.context_entries(batch.taps.flatten(0, 1), positions.repeat(seqs))
    entries = entries.view(len(drafter.layers), seqs, width, -1)  # [layers, S, L, 2 * kv * d]
    allowed = batch.allowed()[:, None]  # [S, 1, A * B, L + A * B]

    def attend(layer: int, q, k, v):
        rows, block, heads, d = q.shape
        kv_heads = k.shape[2]
        ctx_k, ctx_v = entries[layer].view(seqs, width, 2, kv_heads, d).unbind(2)
        per_seq = lambda x: x.reshape(seqs, -1, x.shape[2], d)  # noqa: E731  [S, A * B, h, d]
        keys = torch.cat([ctx_k, per_seq(k)], 1).transpose(1, 2)  # [S, kv, L + A * B, d]
        values = torch.cat([ctx_v, per_seq(v)], 1).transpose(1, 2)
        out = F.scaled_dot_product_attention(per_seq(q).transpose(1, 2), keys, values,
                                             attn_mask=allowed, enable_gqa=True)  # fmt: skip
        return out.transpose(1, 2).reshape(rows, block, heads, d)

    noise = embed(batch.block_ids) * drafter.config.input_embedding_scale
    return drafter.block_hidden(noise, batch.positions, attend)


def losses(drafter, lm_head, hidden, batch: Batch, gamma: float):
    """(weighted CE of the logits, selector CE, per-row draft logits) of one step."""
    rows = hidden[:, 1:]  # [R, B - 1, H]
    logits = drafter.logits(rows, lm_head)  # [R, B - 1, V]
    labels = batch.labels
    known = labels != IGNORE
    weights = torch.exp(-torch.arange(labels.shape[1]) / gamma)[None].expand_as(labels)[known]
    ce = F.cross_entropy(logits[known], labels[known], reduction="none")
    lm = (ce * weights).sum() / weights.sum()
    selector = drafter.candidate_selector
    unary, ids = selector.candidates(logits)
    previous = torch.cat([batch.block_ids[:, :1], labels[:, :-1].clamp_min(0)], 1)
    hit = (ids == labels[..., None]) & known[..., None]  # [R, B - 1, k]
    usable = hit.any(-1)
    projected = selector.hidden_projection(rows)
    scores = selector.scores(projected[usable], unary[usable], ids[usable], previous[usable])
    sel = F.cross_entropy(scores.float(), hit[usable].float().argmax(-1)) if usable.any() else 0
    return lm, sel, logits


@torch.no_grad()
def accept_length(drafter, embed, lm_head, examples: list[Example], block: int, mask_id: int):
    """Mean greedy tokens per verify step (accepted drafts + 1) over every held-out anchor."""
    total, count = 0.0, 0
    rng = random.Random(0)
    for example in examples:  # every anchor of one conversation per batch
        batch = Batch([example], example.anchors.numel(), block, mask_id, rng)
        hidden = forward(drafter, embed, batch)
        logits = drafter.logits(hidden[:, 1:], lm_head)
        zeros = torch.zeros(logits.shape[0])
        unary, ids = drafter.candidate_selector.candidates(logits)
        path = drafter.candidate_selector.walk(
            hidden[:, 1:],
            unary,
            ids,
            batch.block_ids[:, 0],
            zeros,
            zeros[:, None].expand(-1, block - 1),
        )
        good = (path.tokens == batch.labels) & (batch.labels != IGNORE)
        total += (good.long().cumprod(1).sum(1) + 1).sum().item()
        count += good.shape[0]
    return total / max(count, 1)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))))


def save(drafter, config: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {name: (p.detach().bfloat16() if p.dim() > 1 else p.detach().float()).contiguous()
             for name, p in drafter.named_parameters()}  # fmt: skip
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    a = ap.add_argument
    a("--out", type=Path, required=True)
    a("--log", type=Path, default=LOG_FILE, help="the training log (jsonl)")
    a("--target", type=Path, default=MODEL_DIR)
    a("--seed", type=int, default=0)
    a("--threads", type=int, default=1, help="1 is fastest on a shared machine")
    a("--train-samples", type=int, default=600)
    a("--eval-samples", type=int, default=40)
    a("--steps", type=int, default=500)
    a("--seqs", type=int, default=8, help="sequences per step")
    a("--anchors", type=int, default=24, help="anchors drawn per sequence per step")
    a("--lr", type=float, default=2e-3)
    a("--warmup", type=int, default=40)
    a("--gamma", type=float, default=4.0, help="loss decay over draft positions")
    a("--block-size", type=int, default=8)
    a("--taps", type=lambda s: [int(x) for x in s.split(",")], default=[2, 5, 8, 11])
    a("--layers", type=int, default=3)
    a("--heads", type=int, default=6)
    a("--kv-heads", type=int, default=2)
    a("--head-dim", type=int, default=32)
    a("--intermediate", type=int, default=768)
    a("--selector-rank", type=int, default=64)
    a("--selector-top-k", type=int, default=8)
    a("--eval-every", type=int, default=100)
    a("--workers", type=int, default=2, help="processes extracting the target's hidden states")
    a("--data-cache", type=Path, help="save / reuse the extracted examples here")
    a("--init-from", type=Path, help="continue from this folder's drafter weights")
    a("--log-every", type=int, default=20)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    log_file = args.log.open("w")

    def log(record: dict) -> None:
        print(json.dumps(record), flush=True)
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    target = GlmMoeDsaForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    target.requires_grad_(False)
    raw_target = json.loads((args.target / "config.json").read_text())
    config = drafter_config(args, raw_target, mask_id)
    drafter = DFlashDraftModel(DFlashConfig.from_dict(config, str(args.out)))
    init_weights(drafter, args.seed)
    if args.init_from:
        state = load_file(args.init_from / "model.safetensors")
        drafter.load_state_dict({k: v.float() for k, v in state.items()})
        log({"stage": "init", "from": str(args.init_from)})
    start = time.time()
    train, held_out = load_data(args)
    log({"stage": "data", "train": len(train), "test": len(held_out),
         "train_anchors": sum(e.anchors.numel() for e in train),
         "elapsed_s": round(time.time() - start, 1)})  # fmt: skip
    embed, lm_head = target.model.embed_tokens, target.lm_head
    train_loop(args, drafter, config, embed, lm_head, train, held_out, mask_id, log)
    log({"stage": "done", "elapsed_s": round(time.time() - start, 1)})


def load_data(args) -> tuple[list[Example], list[Example]]:
    """The train and held-out examples: from --data-cache when it exists, else built (and saved
    there when --data-cache is given)."""
    if args.data_cache and args.data_cache.is_file():
        cached = torch.load(args.data_cache)
        return [Example(*e) for e in cached["train"]], [Example(*e) for e in cached["test"]]
    common = (args.taps, args.block_size, args.workers)
    train = build(args.target, args.seed, "train", args.train_samples, *common)
    held_out = build(args.target, args.seed + 1, "test", args.eval_samples, *common)
    if args.data_cache:
        torch.save({"train": [tuple(e) for e in train], "test": [tuple(e) for e in held_out]},
                   args.data_cache)  # fmt: skip
    return train, held_out


def train_loop(args, drafter, config, embed, lm_head, train, held_out, mask_id, log) -> None:
    rng = random.Random(args.seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start = time.time()
    for step in range(args.steps):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        batch = Batch(rng.sample(train, args.seqs), args.anchors, args.block_size, mask_id, rng)
        hidden = forward(drafter, embed, batch)
        lm, sel, _ = losses(drafter, lm_head, hidden, batch, args.gamma)
        optim.zero_grad(set_to_none=True)
        (lm + sel).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        if step % args.log_every == 0:
            selector = float(sel.detach() if torch.is_tensor(sel) else sel)
            log(
                {
                    "stage": "train",
                    "step": step,
                    "lm": round(lm.item(), 4),
                    "selector": round(selector, 4),
                    "elapsed_s": round(time.time() - start, 1),
                }
            )
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            drafter.eval()
            tau = accept_length(drafter, embed, lm_head, held_out, args.block_size, mask_id)
            drafter.train()
            log({"stage": "eval", "step": step + 1, "accept_length": round(tau, 3)})
            save(drafter, config, args.out)


if __name__ == "__main__":
    main()
