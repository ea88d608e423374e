"""The bytes one batch-1 decode step must read: the floor a step's time is measured against.

Per decoder layer: every projection (q_a, kv_a, q_b, kv_b as the absorbed W_UK / W_UV, o_proj, the
indexer's wk, weights_proj and wq_b), the dense MLP or the shared expert with the router and the
`top_k` routed experts one token uses, and the norms; from the pool, the `min(context, topk)` MLA
entries the attention reads and, in a layer with its own indexer, every cached index key once the
context is longer than topk. Plus one embedding row, the final norm and the LM head. Sizes are
the tensors' own (fp32 / bf16 weights; fp32, bf16 or FP8 pool rows).
"""

from __future__ import annotations

from torch import nn

from dsaserve.layers.moe import MoE


def _bytes(module: nn.Module | None) -> int:
    if module is None:
        return 0
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _layer_weights(layer: nn.Module) -> int:
    mlp = layer.mlp
    total = _bytes(layer.self_attn) + _bytes(layer.input_layernorm)
    total += _bytes(layer.post_attention_layernorm)
    if not isinstance(mlp, MoE):
        return total + _bytes(mlp)
    experts = mlp.experts
    per_expert = sum(p[0].numel() * p.element_size()
                     for p in (experts.gate_up_proj, experts.down_proj))  # fmt: skip
    return total + _bytes(mlp.shared_experts) + _bytes(mlp.gate) + mlp.gate.top_k * per_expert


def step_bytes(engine, context: int) -> int:
    """Bytes a batch-1 decode step at `context` tokens reads (see the module docstring)."""
    model, pool = engine.model, engine.pool
    layers = model.model.layers[: engine.model_config.num_hidden_layers]
    total = sum(_layer_weights(layer) for layer in layers)
    embed = model.model.embed_tokens.weight
    total += embed.shape[1] * embed.element_size() + _bytes(model.model.norm)
    total += _bytes(model.lm_head)
    entry = pool.kv_cache.shape[-1] * pool.kv_cache.element_size()
    key = pool.index_cache.shape[-1] * pool.index_cache.element_size()
    for layer in layers:
        indexer = layer.self_attn.indexer
        topk = engine.model_config.index_topk
        total += min(context, topk) * entry
        if indexer is not None and context > topk:
            total += context * key
    return total
