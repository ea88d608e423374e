"""Train the embedded default model (glm_moe_dsa + one MTP layer) on synthetic conversations.

Reproducible (seeded) and CPU-sized: about 45 minutes on 2 cores. Stages:
  1. main model, dense attention, LM loss + indexer KL (DeepSeek-V3.2 dense warm-up);
  2. main model, DSA top-k on (index_topk), LM loss + indexer KL over the selected tokens;
  3. MTP layer (main model frozen): predicts token t+2, dense then sparse, with its indexer KL.
The MoE router uses aux-loss-free balancing (its e_score_correction_bias is nudged toward the
mean load after each step). Output: config.json + model.safetensors in --out (the tokenizer,
template and generation_config already live there). Run:
  python scripts/train_default_model.py --out dsaserve/assets/default_model
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import default_model_fast as fast
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoTokenizer, GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_model_batches import batches, encode  # noqa: E402
from default_model_data import samples  # noqa: E402
from default_model_mtp import save_checkpoint, train_mtp  # noqa: E402
from default_model_tokenizer import MODEL_DIR  # noqa: E402


def model_config(tokenizer, layers: int = 3) -> GlmMoeDsaConfig:
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"])
    return GlmMoeDsaConfig(
        vocab_size=len(tokenizer), hidden_size=192, intermediate_size=512,
        moe_intermediate_size=192, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=32,
        qk_nope_head_dim=32, v_head_dim=32, n_group=1, topk_group=1, norm_topk_prob=True,
        max_position_embeddings=65536, rms_norm_eps=1e-5, first_k_dense_replace=1,
        index_topk=64, index_head_dim=64, index_n_heads=8,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=ids, pad_token_id=ids[0],
        num_nextn_predict_layers=1, initializer_range=0.02,
    )  # fmt: skip


def lm_loss(
    lm_head, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, shift: int = 1
):
    """CE of hidden[:, i] predicting input_ids[:, i + shift] where loss_mask marks a target."""
    chosen = loss_mask[:, shift:].bool()
    width = chosen.shape[1]
    logits = lm_head(hidden[:, :width][chosen])
    return F.cross_entropy(logits.float(), input_ids[:, shift:][chosen])


class RouterBalance:
    """Aux-loss-free MoE balancing: count expert loads through a hook, then nudge the bias."""

    def __init__(self, model: torch.nn.Module, rate: float) -> None:
        self.rate = rate
        self.loads: dict[GlmMoeDsaTopkRouter, torch.Tensor] = {}
        for module in model.modules():
            if isinstance(module, GlmMoeDsaTopkRouter):
                module.register_forward_hook(self._count)

    def _count(self, module, args, output):
        topk = output[2]
        counts = torch.bincount(topk.flatten(), minlength=module.num_experts).float()
        self.loads[module] = self.loads.get(module, 0) + counts

    @torch.no_grad()
    def step(self) -> None:
        for router, load in self.loads.items():
            router.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
        self.loads.clear()


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def trained_part(model, last: int) -> torch.nn.Module:
    """The module fine-tuned: the whole model, or (`last` > 0) only its last `last` decoder
    layers and final norm, the rest frozen (embeddings and lm_head, which the MTP layer shares,
    included); the routers of frozen layers are not rebalanced either."""
    if not last:
        return model
    model.requires_grad_(False)
    part = torch.nn.ModuleList([*model.model.layers[-last:], model.model.norm])
    part.requires_grad_(True)
    return part


def train_main(model, stream, args, log) -> None:
    part = trained_part(model, args.train_last)
    balance = RouterBalance(part, rate=1e-3)
    params = [p for p in part.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sparse_from = int(args.steps * args.dense_fraction)
    start = time.time()
    model.train()
    for step in range(args.steps):
        sparse = step >= sparse_from
        batch = next(stream)
        for group in optim.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        out = fast.forward(model, batch.input_ids, batch.attention_mask, sparse, args.kl_rows)
        loss = lm_loss(model.lm_head, out.hidden, batch.input_ids, batch.loss_mask)
        optim.zero_grad(set_to_none=True)
        (loss + args.kl_weight * out.kl).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        balance.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            log({"stage": "main", "step": step, "sparse": sparse, "lm": round(loss.item(), 4),
                 "index_kl": round(out.kl.item(), 4), "tokens": batch.input_ids.numel(),
                 "elapsed_s": round(time.time() - start, 1)})  # fmt: skip
        if args.save_every and step and step % args.save_every == 0:
            save_checkpoint(model, None, args.out, args.bf16_weights)
        if step + 1 == args.stop_after:
            save_checkpoint(model, None, args.out, args.bf16_weights)
            raise SystemExit(f"stopped after {args.stop_after} steps (--stop-after)")
    model.requires_grad_(True)
    model.eval()


def _weights(text: str) -> dict[str, int]:
    pairs = [item.split("=") for item in text.split(",") if item]
    return {kind: int(weight) for kind, weight in pairs}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=MODEL_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--train-samples", type=int, default=16000)
    parser.add_argument("--steps", type=int, default=330)
    parser.add_argument("--mtp-steps", type=int, default=80)
    parser.add_argument(
        "--mtp-rollout",
        type=int,
        default=1,
        help="chained draft steps trained per MTP step (EAGLE-style)",
    )
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--dense-fraction", type=float, default=0.5)
    parser.add_argument("--kl-weight", type=float, default=1.0)
    parser.add_argument("--kl-rows", type=int, default=2, help="sequences per batch in the KL")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--stop-after", type=int, default=0, help="save and exit after N steps")
    parser.add_argument("--init-from", type=Path, help="start from this folder's main weights")
    parser.add_argument("--layers", type=int, default=3, help="main layers (first one dense)")
    parser.add_argument(
        "--train-last", type=int, default=0, help="fine-tune only the last N layers (0: all)"
    )
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--bf16-weights", action="store_true", help="store matrices in bf16")
    parser.add_argument(
        "--mtp-init-from", type=Path, help="start the MTP layer from this folder's MTP"
    )
    parser.add_argument(
        "--kind-weights",
        type=_weights,
        default={},
        help="override data mix weights, e.g. pct=44,mul=12,search=6",
    )
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "train_log.jsonl"
    log_file = log_path.open("w")

    def log(record: dict) -> None:
        print(json.dumps(record), flush=True)
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()

    drawn = samples(args.seed, "train", args.train_samples, args.kind_weights)
    data = [encode(s, tokenizer) for s in drawn]
    log({"stage": "data", "examples": len(data), "tokens": sum(len(e.ids) for e in data)})
    config = model_config(tokenizer, args.layers)
    config._attn_implementation = "eager"
    model = GlmMoeDsaForCausalLM(config)
    if args.init_from:
        state = load_file(args.init_from / "model.safetensors")
        prefix = f"model.layers.{config.num_hidden_layers}."
        model.load_state_dict({k: v for k, v in state.items() if not k.startswith(prefix)})
        log({"stage": "init", "from": str(args.init_from)})
    probe = next(batches(data, 1024, random.Random(1), tokenizer.pad_token_id))
    median, frac_off = fast.check_matches_reference(model, probe.input_ids, probe.attention_mask, 8)
    log({"stage": "check", "median_abs_logit_diff": median, "fraction_off": frac_off})
    if median > 1e-4 or frac_off > 0.02:
        raise SystemExit("the training forward does not match transformers")
    stream = batches(data, args.token_budget, rng, tokenizer.pad_token_id)
    train_main(model, stream, args, log)
    save_checkpoint(model, None, args.out, args.bf16_weights)
    mtp = train_mtp(model, stream, args, log, lm_loss)
    save_checkpoint(model, mtp, args.out, args.bf16_weights)
    log({"stage": "done"})


if __name__ == "__main__":
    main()
