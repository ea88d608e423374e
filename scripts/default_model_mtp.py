"""The MTP (nextn) layer of the default model: module, training and checkpoint writing.

Forward at position i (GLM / DeepSeek nextn): e = Emb(t_{i+1}); h = the main model's final hidden
state at i after `model.norm`; u = eh_proj([enorm(e) ‖ hnorm(h)]); h' = decoder layer(u) (causal,
its own MLA + indexer + MoE); logits = lm_head(shared_head.norm(h')) predict t_{i+2}. The main
`embed_tokens` and `lm_head` are shared (no copies are saved), GLM style. Weights are written at
`model.layers.{num_hidden_layers}.*`, which `GlmMoeDsaForCausalLM.from_pretrained` ignores.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import default_model_fast as fast
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
    GlmMoeDsaDecoderLayer,
    GlmMoeDsaRMSNorm,
)

GENERIC_CONFIG_KEYS = {
    "_attn_implementation", "_name_or_path", "id2label", "label2id", "chunk_size_feed_forward",
    "is_encoder_decoder", "output_attentions", "output_hidden_states", "return_dict",
    "problem_type",
}  # fmt: skip


class SharedHead(nn.Module):
    """Holds only the MTP output norm; the head itself is the main lm_head."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = GlmMoeDsaRMSNorm(hidden, eps)


class MtpLayer(GlmMoeDsaDecoderLayer):
    """A full decoder layer plus enorm / hnorm / eh_proj / shared_head.norm."""

    def __init__(self, config) -> None:
        mtp_config = copy.deepcopy(config)
        layer_idx = config.num_hidden_layers
        mtp_config.num_hidden_layers = layer_idx + 1
        mtp_config.mlp_layer_types = list(config.mlp_layer_types) + ["sparse"]
        mtp_config.indexer_types = list(config.indexer_types) + ["full"]
        super().__init__(mtp_config, layer_idx)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = GlmMoeDsaRMSNorm(hidden, eps)
        self.hnorm = GlmMoeDsaRMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(hidden, eps)

    def draft(self, model, input_ids, hidden, attention_mask, sparse: bool, kl_rows: int = 0):
        """h' at positions 0..S-2 (predicting t_{i+2}) from ids [B, S] and normed hidden."""
        emb = model.model.embed_tokens(input_ids[:, 1:])  # e_i = Emb(t_{i+1})
        u = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden[:, :-1])], dim=-1))
        positions = torch.arange(u.shape[1])[None].expand(u.shape[0], -1)
        cos_sin = model.model.rotary_emb(u, position_ids=positions)
        allowed = fast.allowed_mask(attention_mask[:, :-1])
        out, kl = fast.layer_forward(self, u, cos_sin, allowed, sparse, kl_rows)
        return self.shared_head.norm(out), kl


def init_mtp(model) -> MtpLayer:
    mtp = MtpLayer(model.config)
    last = model.model.layers[-1]
    mtp.load_state_dict(last.state_dict(), strict=False)  # start from the last main layer
    hidden = model.config.hidden_size
    with torch.no_grad():
        eye = torch.eye(hidden) * 0.7
        mtp.eh_proj.weight.copy_(torch.cat([eye, eye], dim=1))
        mtp.shared_head.norm.weight.copy_(model.model.norm.weight)
    return mtp


def train_mtp(model, stream, args, log, lm_loss) -> MtpLayer:
    model.requires_grad_(False)
    mtp = init_mtp(model)
    if args.mtp_init_from:  # continue an MTP layer trained on these main weights
        prefix = f"model.layers.{model.config.num_hidden_layers}."
        state = load_file(args.mtp_init_from / "model.safetensors")
        mtp.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    optim = torch.optim.AdamW(mtp.parameters(), lr=args.lr * 0.5, betas=(0.9, 0.95))
    start = time.time()
    for step in range(args.mtp_steps):
        sparse = step >= args.mtp_steps // 2
        batch = next(stream)
        with torch.no_grad():
            hidden = fast.forward(model, batch.input_ids, batch.attention_mask, sparse=True).hidden
        loss, kl = rollout_loss(model, mtp, batch, hidden, sparse, args, lm_loss)
        optim.zero_grad(set_to_none=True)
        (loss + args.kl_weight * kl).backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        optim.step()
        if step % 20 == 0 or step == args.mtp_steps - 1:
            elapsed = round(time.time() - start, 1)
            log({"stage": "mtp", "step": step, "sparse": sparse, "lm": round(loss.item(), 4),
                 "index_kl": round(kl.item(), 4), "elapsed_s": elapsed})  # fmt: skip
    return mtp.eval()


def rollout_loss(model, mtp: MtpLayer, batch, hidden, sparse: bool, args, lm_loss):
    """Mean LM loss of `args.mtp_rollout` chained draft steps, and the first step's indexer KL.

    Step 1 predicts t_{i+2} from the main model's hidden at i; step k > 1 predicts t_{i+k+1} from
    step k-1's own output (shared_head.norm(h')), teacher-forced tokens: the later draft
    positions are trained on the input they get at serving time (EAGLE's training-time test).
    """
    ids, mask, loss_mask = batch.input_ids, batch.attention_mask, batch.loss_mask
    losses, kl = [], None
    for k in range(args.mtp_rollout):
        if ids.shape[1] < 3:
            break
        hidden, step_kl = mtp.draft(model, ids, hidden, mask, sparse, args.kl_rows if k == 0 else 0)
        kl = step_kl if kl is None else kl
        if loss_mask[:, 2:].any():
            losses.append(lm_loss(model.lm_head, hidden, ids, loss_mask, shift=2))
        ids, mask, loss_mask = ids[:, 1:], mask[:, 1:], loss_mask[:, 1:]
    return torch.stack(losses).mean(), kl


def save_checkpoint(model, mtp: MtpLayer | None, out: Path, bf16: bool = False) -> None:
    """config.json + one model.safetensors holding the main model and the MTP layer. With `bf16`
    the matrices are stored in bfloat16 (half the bytes; vectors and config dtype stay fp32, so
    transformers and dsaserve load them into an fp32 model)."""
    out.mkdir(parents=True, exist_ok=True)
    if mtp is None:
        mtp = init_mtp(model)
    prefix = f"model.layers.{model.config.num_hidden_layers}."
    tensors = dict(model.state_dict()) | {prefix + k: v for k, v in mtp.state_dict().items()}
    for name, value in tensors.items():
        value = value.detach().contiguous()
        tensors[name] = value.bfloat16() if bf16 and value.dim() >= 2 else value
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in model.config.to_dict().items() if k not in GENERIC_CONFIG_KEYS}
    config["architectures"] = ["GlmMoeDsaForCausalLM"]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
