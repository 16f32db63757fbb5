"""The model as the planner sees it: parameter shapes, FLOPs and activation memory, from a GPT shape.

[Note: what the planner needs of a model]
Three things: the parameter numels in registration order (so the ODO's own bucketing gives the exact padded buckets
a plan would build), the training FLOPs per token (Megatron-LM's formula, the one seed 004 uses for MFU: attention
FLOPs are *not* halved for the causal mask), and the activation bytes per micro-batch (Korthikanti et al. 2022, the
formula Megatron-LM's memory report uses). The parameter list mirrors megatron-core's ``GPTModel`` with the local
or TE layer spec: embedding (word, learned positions), then per layer input norm, ``linear_proj``, ``linear_qkv``,
pre-MLP norm, ``linear_fc1``, ``linear_fc2``, then the final norm and the output layer (absent when tied). With
pipeline parallelism each stage holds its share (``stage_param_numels``) and the planner sizes buckets and optimizer
memory for the busiest stage. Tests check it against real megatron-core models (TP 1/2, PP 2).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional


def gpt_name(num_layers: int, hidden_size: int) -> str:
    """The name of a GPT shape: the key under which a measured profile keeps its compute rate
    (``compute_by_model``), so the tools that measure it and the planner that reads it must spell it alike."""
    return f"gpt-{num_layers}x{hidden_size}"


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's ``--ffn-hidden-size`` when not given: 4h, or with SwiGLU (two input projections) 2/3 of that
    rounded down to a multiple of 64, so that the MLP keeps about 4h's parameters."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A GPT shape in Megatron's terms (``--num-layers``, ``--hidden-size``, ...)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int
    ffn_hidden_size: Optional[int] = None       # default: Megatron-LM's (default_ffn_hidden_size)
    num_query_groups: Optional[int] = None      # GQA; None: = heads
    swiglu: bool = False
    add_bias_linear: bool = True
    normalization: str = "LayerNorm"            # or "RMSNorm" (no bias)
    position_embedding: str = "learned_absolute"   # or "rope" / "none" (no parameters)
    untie_embeddings: bool = True               # output layer separate (LLaMA); Megatron's flags default to tied
    kv_channels: Optional[int] = None           # --kv-channels; None: hidden / heads
    max_position_embeddings: Optional[int] = None   # rows of the learned position table; None: seq_length
    qk_layernorm: bool = False                  # --qk-layernorm: a norm over each head's queries and keys

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} (--{f.replace('_', '-')}) must be >= 1, got {getattr(self, f)}")
        if self.hidden_size % self.num_attention_heads and not self.kv_channels:
            raise ValueError(f"--hidden-size {self.hidden_size} must be divisible by --num-attention-heads "
                             f"{self.num_attention_heads} unless --kv-channels is given")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or default_ffn_hidden_size(self.hidden_size, self.swiglu)

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    # -- parameters -------------------------------------------------------------------------------------------
    def param_numels(self, tp: int = 1) -> List[int]:
        """Per-rank parameter numels in megatron-core's registration order, with tensor parallelism ``tp`` (column
        and row parallel weights split, norms and row-parallel biases replicated, vocabulary split)."""
        return self.stage_param_numels(tp, 1, 0)

    def stage_param_numels(self, tp: int = 1, pp: int = 1, stage: int = 0) -> List[int]:
        """``param_numels`` of pipeline stage ``stage`` of ``pp``: the embedding on the first, the final norm and
        the output layer on the last (with ``pp > 1`` the last stage holds its own copy of a tied output weight,
        as megatron-core allocates it), ``num_layers / pp`` layers each (the first stages take a remainder)."""
        if not 0 <= stage < pp:
            raise ValueError(f"stage {stage} is not one of {pp} pipeline stages")
        h, f = self.hidden_size, self.ffn
        q = self.head_dim * self.num_attention_heads
        kv = self.head_dim * self.query_groups
        norm = [h, h] if self.normalization == "LayerNorm" else [h]
        bias = self.add_bias_linear
        first, last = stage == 0, stage == pp - 1
        out: List[int] = []
        if first:
            out.append(self.vocab_size * h // tp)
            if self.position_embedding == "learned_absolute":
                out.append((self.max_position_embeddings or self.seq_length) * h)
        fc1 = (2 if self.swiglu else 1) * f
        for _ in range(self.num_layers // pp + (1 if stage < self.num_layers % pp else 0)):
            out += norm
            out += [q * h // tp] + ([h] if bias else [])
            out += [(q + 2 * kv) * h // tp] + ([(q + 2 * kv) // tp] if bias else [])
            if self.qk_layernorm:   # q_layernorm, k_layernorm over one head (replicated across TP)
                out += [self.head_dim] * (2 * len(norm))
            out += norm
            out += [fc1 * h // tp] + ([fc1 // tp] if bias else [])
            out += [h * f // tp] + ([h] if bias else [])
        if last:
            out += norm
            if self.untie_embeddings or not first:
                out.append(self.vocab_size * h // tp)
        return out

    def busiest_stage(self, tp: int = 1, pp: int = 1) -> int:
        """The stage with the most parameters: the one whose optimizer memory and traffic bound a plan."""
        return max(range(pp), key=lambda s: sum(self.stage_param_numels(tp, pp, s)))

    def busiest_stage_numels(self, tp: int = 1, pp: int = 1) -> List[int]:
        return self.stage_param_numels(tp, pp, self.busiest_stage(tp, pp))

    def stage_deferred_numel(self, tp: int = 1, pp: int = 1, stage: int = 0, sequence_parallel: bool = False) -> int:
        """Elements of the stage's parameters whose gradients are reduced over a model-parallel group before DP
        (the ODO's deferred buckets, ``optimizer/model_parallel.py``): a tied embedding or output weight split over
        pipeline stages; with TP the q/k norms, and with sequence parallelism also the norms and the row-parallel
        biases, which megatron-core marks ``sequence_parallel``."""
        first, last = stage == 0, stage == pp - 1
        n = 0
        if pp > 1 and not self.untie_embeddings and (first or last):
            n += self.vocab_size * self.hidden_size // tp
        if tp > 1:   # the q/k norms are summed over TP with or without sequence parallelism
            h, per_norm = self.hidden_size, (2 if self.normalization == "LayerNorm" else 1)
            layers = self.num_layers // pp + (1 if stage < self.num_layers % pp else 0)
            per_layer = 2 * per_norm * self.head_dim if self.qk_layernorm else 0
            if sequence_parallel:
                per_layer += 2 * per_norm * h + (2 * h if self.add_bias_linear else 0)
            n += layers * per_layer + (per_norm * h if sequence_parallel and last else 0)
        return n

    @property
    def num_params(self) -> int:
        return sum(self.param_numels())

    # -- compute ----------------------------------------------------------------------------------------------
    def flops_per_sequence(self) -> float:
        """Forward + backward FLOPs of one sequence (Megatron-LM's ``num_floating_point_operations``, dense)."""
        h, L, s = self.hidden_size, self.num_layers, self.seq_length
        gated = 1.5 if self.swiglu else 1.0
        q_ratio = self.head_dim * self.num_attention_heads / h     # Megatron's query_projection_to_hidden_size_ratio
        attn = (1 + self.query_groups / self.num_attention_heads + s / h) * q_ratio
        mlp = self.ffn / h * gated
        logit = self.vocab_size / (2 * L * h)
        return 12.0 * s * L * h * h * (attn + mlp + logit)

    # -- activations ------------------------------------------------------------------------------------------
    def activation_bytes(self, micro_batch: int, *, tp: int = 1, pp: int = 1, micro_batches: int = 1,
                         recompute: str = "none", recompute_method: Optional[str] = None,
                         recompute_num_layers: Optional[int] = None, sequence_parallel: bool = True,
                         stores_attention_scores: bool = False) -> int:
        """Activation bytes on the busiest rank (pipeline stage 0) for 16-bit activations.

        Korthikanti et al. 2022 per layer and micro-batch: ``s*b*h*(34 + 5*a*s/h)/t`` with sequence parallelism
        (``10 + 24/t`` instead of ``34/t`` without); flash/fused attention keeps no ``a*s*s`` scores
        (``stores_attention_scores=False``, the GPU default); selective recompute drops the scores too. Full
        recompute follows megatron-core's grouping (``transformer/recompute_plan.py``) of a stage's layers:
        ``block`` -- the first ``recompute_num_layers`` layers keep only their input (``2*s*b*h/t``), the others
        everything; ``uniform`` -- chunks of ``recompute_num_layers`` layers keep only the chunk's input; plus, in
        backward, the working set of what is recomputed at once (one layer for block, one chunk for uniform).
        ``recompute_method=None`` is uniform with one layer per chunk (every layer recomputed). Stage 0 of a 1F1B
        pipeline holds ``min(pp, M)`` micro-batches of its ``L/pp`` layers. The logits (fp32, with their
        gradient) are added on the last stage's share.
        """
        s, b, h, a = self.seq_length, micro_batch, self.hidden_size, self.num_attention_heads
        base = 34.0 / tp if sequence_parallel else 10.0 + 24.0 / tp
        scores = 5.0 * a * s / h / tp if (stores_attention_scores and recompute != "selective") else 0.0
        per_layer = s * b * h * (base + scores)
        layer_input = 2.0 * s * b * h / (tp if sequence_parallel else 1)
        layers = -(-self.num_layers // pp)
        in_flight = min(pp, micro_batches)
        if recompute == "full":
            n = recompute_num_layers if recompute_num_layers is not None else 1
            if n < 1:
                raise ValueError(f"recompute_num_layers (--recompute-num-layers) must be >= 1, got {n}")
            if recompute_method == "block":
                n = min(n, layers)
                held = (n * layer_input + (layers - n) * per_layer) * in_flight + per_layer
            elif recompute_method in (None, "uniform"):
                held = -(-layers // n) * layer_input * in_flight + min(n, layers) * per_layer
            else:
                raise ValueError("recompute_method must be uniform or block (--recompute-method), got "
                                 f"{recompute_method!r}")
        elif recompute in ("none", "selective"):
            held = layers * per_layer * in_flight
        else:
            raise ValueError(f"recompute must be none, selective or full (--recompute-granularity), got {recompute!r}")
        logits = 8.0 * s * b * self.vocab_size / tp
        return int(held + logits)


def _llama(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, vocab_size=32000, seq_length=4096, ffn_hidden_size=ffn,
                     swiglu=True, add_bias_linear=False, normalization="RMSNorm", position_embedding="rope")


def _gpt(name: str, layers: int, hidden: int, heads: int, seq: int = 2048) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, vocab_size=50304, seq_length=seq)


# Seed 004 trains LLaMA-7B/13B/30B (shapes of the LLaMA paper). Seed 000's Table 2 names 18B-138B GPT models
# without their shapes (they are in an appendix the seed does not include): the shapes below are assumptions
# with the stated parameter counts (12 L h^2 + embeddings), written down so the simulation can be rerun.
MODEL_PRESETS: Dict[str, ModelSpec] = {m.name: m for m in (
    _llama("llama-7b", 32, 4096, 32, 11008),
    _llama("llama-13b", 40, 5120, 40, 13824),
    _llama("llama-30b", 60, 6656, 52, 17920),
    _llama("llama-65b", 80, 8192, 64, 22016),
    _gpt("gpt-18b", 40, 6144, 48),
    _gpt("gpt-49b", 60, 8192, 64),
    _gpt("gpt-91b", 72, 10240, 80),
    _gpt("gpt-138b", 76, 12288, 96),
)}


def model_preset(name: str, **overrides) -> ModelSpec:
    """A named shape (``--model``), with Megatron flags overriding its fields (e.g. ``seq_length``)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"--model must be one of {sorted(MODEL_PRESETS)}, got {name!r}")
    spec = MODEL_PRESETS[name]
    return dataclasses.replace(spec, **{k: v for k, v in overrides.items() if v is not None})
