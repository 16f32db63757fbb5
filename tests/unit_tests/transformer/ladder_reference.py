"""Hand-written single-process reference for standard / Ladder (eq. 2) / Desync GPT forward passes.

Takes the *full* (TP=1) parameters by megatron-core name and simulates ``k`` tensor-parallel ranks where the
architecture depends on it (Desync): rank j owns heads ``j*np/k..`` and MLP columns ``j*ffn/k..`` and keeps its
own residual stream between reductions. Written from seed 002 eqs. 1-2 and section 5, independent of the code
under test.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

P = "decoder.layers.{}."


def _ln(x, params, name, eps=1e-5):
    return F.layer_norm(x, x.shape[-1:], params[name + ".weight"], params[name + ".bias"], eps)


def _attn_partial(x, params, i, heads, j, k):
    """Rank j's partial attention output (no proj bias), x: [s, b, h]."""
    pre = P.format(i) + "self_attention."
    s, b, h = x.shape
    hn = h // heads
    per = heads // k
    w = params[pre + "linear_qkv.weight"].view(heads, 3, hn, h)[j * per:(j + 1) * per]
    bias = params[pre + "linear_qkv.bias"].view(heads, 3, hn)[j * per:(j + 1) * per]
    qkv = torch.einsum("sbh,ntdh->sbntd", x, w) + bias
    q, kk, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]  # [s, b, n, d]
    scores = torch.einsum("sbnd,tbnd->bnst", q, kk) / math.sqrt(hn)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    ctx = torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, per * hn)
    wp = params[pre + "linear_proj.weight"][:, j * per * hn:(j + 1) * per * hn]
    return ctx @ wp.t()


def _mlp_partial(x, params, i, j, k):
    pre = P.format(i) + "mlp."
    w1, b1 = params[pre + "linear_fc1.weight"], params[pre + "linear_fc1.bias"]
    f = w1.shape[0] // k
    hmid = F.gelu(x @ w1[j * f:(j + 1) * f].t() + b1[j * f:(j + 1) * f])
    return hmid @ params[pre + "linear_fc2.weight"][:, j * f:(j + 1) * f].t()


def _module(params, i, kind, x_per_rank: List[torch.Tensor], heads, k):
    """Partial outputs per simulated rank and the module's bias."""
    pre = P.format(i)
    if kind == "attn":
        xs = [_ln(x, params, pre + "input_layernorm") for x in x_per_rank]
        parts = [_attn_partial(xs[j], params, i, heads, j, k) for j in range(k)]
        return parts, params[pre + "self_attention.linear_proj.bias"]
    xs = [_ln(x, params, pre + "pre_mlp_layernorm") for x in x_per_rank]
    return [_mlp_partial(xs[j], params, i, j, k) for j in range(k)], params[pre + "mlp.linear_fc2.bias"]


def decoder(params: Dict[str, torch.Tensor], x: torch.Tensor, num_layers: int, heads: int, *,
            ladder_layers: int = 0, desync: Optional[str] = None, k: int = 1) -> torch.Tensor:
    """Standard layers below, ladder on the upper ``ladder_layers``; or desync over all layers with k ranks."""
    if desync:
        n = int(desync[0])
        rs = [x] * k
        for m in range(2 * num_layers):
            parts, bias = _module(params, m // 2, ("attn", "mlp")[m % 2], rs, heads, k)
            if (m + 1) % n == 0:
                s = sum(parts[j] + rs[j] / k for j in range(k)) + bias
                rs = [s] * k
            else:
                rs = [rs[j] + parts[j] + bias for j in range(k)]
        return rs[0] if (2 * num_layers) % n == 0 else sum(rs) / k
    # eq. 1 for the lower layers: x_i = h_i(x_{i-1}) + x_{i-1}
    first_ladder = num_layers - ladder_layers
    for m in range(2 * first_ladder):
        parts, bias = _module(params, m // 2, ("attn", "mlp")[m % 2], [x], heads, 1)
        x = x + parts[0] + bias
    # eq. 2 for the upper layers: x_i = h_i(x_{i-2}) + x_{i-1}; h of the first ladder module reads x_{-1} = x_0
    xs = [x, x]  # x_{i-2}, x_{i-1}
    for m in range(2 * first_ladder, 2 * num_layers):
        parts, bias = _module(params, m // 2, ("attn", "mlp")[m % 2], [xs[0]], heads, 1)
        new = xs[1] + parts[0] + bias
        xs = [xs[1], new]
    return xs[1]


def gpt_losses(params, tokens, labels, num_layers, heads, **wiring) -> torch.Tensor:
    """Per-token cross-entropy [b, s] of the full model (learned absolute positions, untied output layer)."""
    s = tokens.shape[1]
    emb = params["embedding.word_embeddings.weight"][tokens] + params["embedding.position_embeddings.weight"][:s]
    h = decoder(params, emb.transpose(0, 1), num_layers, heads, **wiring)
    h = _ln(h, params, "decoder.final_layernorm")
    logits = h @ params["output_layer.weight"].t()  # [s, b, V]
    return F.cross_entropy(logits.transpose(0, 1).reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           reduction="none").view_as(labels)
