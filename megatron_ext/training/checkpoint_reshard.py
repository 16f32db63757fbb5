"""Rewrite a pretrain_gpt checkpoint for other tensor/pipeline-parallel sizes (``tools/reshard_checkpoint.py``).

A resume may change the DP size on its own (the optimizer state is canonical per parameter), but a checkpoint holds
one ``mp_rank_TT_PPP`` directory per TP/PP position, each with that position's slices of the weights and of their
optimizer states. This is Megatron-LM's ``tools/checkpoint/convert.py`` for our layout: offline, one process, no
process group, and the source is never written to.

[Note: reshard rules]
* Pipeline: a stage-local ``decoder.layers.<j>`` of model chunk ``c`` is global layer ``offset(stage, c) + j``, by
  megatron-core's placement (``pipeline_layout.py``: even, or the uneven splits Megatron-LM's flags choose, V model
  chunks per stage; the target keeps the source's split unless told another); the embedding lives on stage 0's first
  chunk, the final norm and output layer on the last stage's last chunk. With tied embeddings and PP > 1 the last
  stage also holds ``output_layer.weight``, a copy of the embedding kept identical by megatron-core's embedding-group
  all-reduce; it is dropped on reading and written again from the embedding (weights and optimizer states) where the
  target needs it.
* Tensor: the layer classes fix the split. Column-parallel weights and biases (``linear_qkv``, ``linear_fc1``,
  ``output_layer``) and the vocab-parallel embedding are split along dim 0, row-parallel weights (``linear_proj``,
  ``linear_fc2``) along dim 1; everything else (norms, row-parallel biases, position embeddings) is replicated:
  at the same TP size each rank keeps its own copy, and when the TP size changes the copies must be equal (checked,
  so that a tensor-parallel parameter these rules do not know is refused by name). A fused SwiGLU
  ``linear_fc1`` holds ``[gate; up]`` per TP rank, so each half is split on its own. The fused QKV weight needs
  nothing special: each TP rank holds whole query groups in order.
* Vocabulary: the embedding and output layer are padded to a multiple of ``--make-vocab-size-divisible-by`` x TP,
  and padded logits take part in the softmax (this tool measured 6.16 against 6.42 at the same step when a TP 2 -> 1
  conversion of a young model cut 200 of 800 rows). So the padded size is kept wherever the new TP divides it, and
  the notice names the ``--make-vocab-size-divisible-by`` that gives it at the new TP. Asked to pad by Megatron-LM's
  rule instead (``--target-make-vocab-size-divisible-by``), padding rows are cut, or added as copies of the last row
  (Megatron-LM's converter) with zero optimizer moments.
* Optimizer state: every per-parameter tensor (master weights, Adam moments, ...) is reshaped to the parameter's
  shape and resharded as the parameter; the param groups of all positions are merged by their overrides.
* RNG states are per rank and are not carried over: the resumed run re-seeds them from ``--seed`` (as at a DP
  change). Iteration, consumed samples and the LR schedule are kept.

Each parameter is merged from the source files (memory-mapped) when a target position needs it, so memory holds one
target position's state and one full parameter, not the model's state.
"""
from __future__ import annotations

import copy
import os
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ..optimizer.checkpoint import canonical_entry
from .checkpointing import (CheckpointError, _load, check_offline_target, chunk_states, find_checkpoint,
                            iter_dir_name, mp_dir_name, offline_checkpoint, verify_checksums)
from .model import padded_vocab_size
from .pipeline_layout import LAYOUT_ARGS, PipelineLayout

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")
_COLUMN = re.compile(r"(^|\.)(linear_qkv|linear_fc1|output_layer)\.(weight|bias)$")
_ROW_WEIGHT = re.compile(r"(^|\.)(linear_proj|linear_fc2)\.weight$")
_VOCAB = re.compile(r"(^|\.)(embedding\.word_embeddings|output_layer)\.weight$")
_EMBEDDING = re.compile(r"(^|\.)embedding\.")
_LAST_STAGE = re.compile(r"(^|\.)(output_layer|decoder\.final_layernorm)\.")
_OUTPUT_WEIGHT = re.compile(r"(^|\.)output_layer\.weight$")
_CHUNK = re.compile(r"^(\d+)\.(.*)$")


class Layout(PipelineLayout):
    """A pipeline layout (``pipeline_layout.py``: even or uneven, with model chunks) at TP ``tp``, and where the
    tensors outside the layers live."""

    def __init__(self, num_layers: int, tp: int, pp: int, vp: int, **split: Any) -> None:
        if tp < 1:
            raise ValueError(f"parallel sizes must be at least 1 (TP {tp})")
        super().__init__(num_layers, pp, vp, **split)
        self.tp = tp

    def holds(self, stage: int, chunk: int, name: str) -> bool:
        """Whether the (stage, chunk) position holds the non-layer tensor ``name``."""
        if _EMBEDDING.search(name):
            return stage == 0 and chunk == 0
        if _LAST_STAGE.search(name):
            return stage == self.pp - 1 and chunk == self.vp - 1
        return True


def layout_of(args: Dict[str, Any], tp: int, pp: int, vp: int) -> Layout:
    """The layout a checkpoint's ``args`` (or a target's) give at these sizes."""
    split = PipelineLayout.from_args(args, pp, vp)
    return Layout(args["num_layers"], tp, pp, vp, first=split.first, last=split.last,
                  account_for_embedding=split.account_for_embedding, account_for_loss=split.account_for_loss)


def global_key(key: str, layout: Layout, stage: int, chunk: int) -> str:
    m = _LAYER.match(key)
    if m is None:
        return key
    return f"{m.group(1)}{layout.offset(stage, chunk) + int(m.group(2))}{m.group(3)}"


def local_key(key: str, layout: Layout) -> Tuple[Optional[Tuple[int, int]], str]:
    """(stage, chunk) of a layer tensor, or None for one outside the layers; and its stage-local name."""
    m = _LAYER.match(key)
    if m is None:
        return None, key
    stage, chunk, local = layout.where(int(m.group(2)))
    return (stage, chunk), f"{m.group(1)}{local}{m.group(3)}"


def tp_split_dim(name: str) -> Optional[int]:
    """The dim a tensor-parallel layer splits ``name`` along; None for a replicated tensor (reshard rules)."""
    if _COLUMN.search(name) or _VOCAB.search(name):
        return 0
    if _ROW_WEIGHT.search(name):
        return 1
    return None


def _gated(name: str, swiglu: bool) -> bool:
    return swiglu and "linear_fc1." in name


def merge_tp(name: str, shards: List[torch.Tensor], swiglu: bool) -> torch.Tensor:
    """The full tensor of ``name`` from its TP shards (in TP rank order). A replicated tensor's copies must be equal:
    one that differs is a tensor-parallel split these rules do not know."""
    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        if any(not torch.equal(shards[0], s) for s in shards[1:]):
            raise CheckpointError(f"{name}: its copies on the {len(shards)} TP ranks differ, so it is not the replicated "
                                  "tensor the reshard rules take it for (a tensor-parallel parameter they do not "
                                  "know): keep the checkpoint's TP size")
        return shards[0]
    if _gated(name, swiglu):
        halves = [s.chunk(2, dim=dim) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves], dim=dim), torch.cat([h[1] for h in halves], dim=dim)],
                         dim=dim)
    return torch.cat(shards, dim=dim)


def split_tp(name: str, full: torch.Tensor, tp: int, rank: int, swiglu: bool) -> torch.Tensor:
    """TP rank ``rank``'s shard of ``full`` (inverse of :func:`merge_tp`), in storage of its own (torch.save writes a
    view's whole storage: a cut vocabulary's rows, another rank's slice)."""
    dim = tp_split_dim(name)
    if dim is None or tp == 1:
        return full.clone()
    if full.shape[dim] % (2 * tp if _gated(name, swiglu) else tp):
        raise CheckpointError(f"{name}: dim {dim} of shape {tuple(full.shape)} does not split over TP {tp}")
    if _gated(name, swiglu):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim=dim)[rank], up.chunk(tp, dim=dim)[rank]], dim=dim)
    return full.chunk(tp, dim=dim)[rank].clone()


def resize_vocab(full: torch.Tensor, rows: int, fill_with_last_row: bool) -> torch.Tensor:
    """Cut or pad the padding rows of a vocab-sized tensor to ``rows`` (reshard rules)."""
    if full.shape[0] >= rows:
        return full[:rows]
    extra = rows - full.shape[0]
    pad = full[-1:].expand(extra, *full.shape[1:]) if fill_with_last_row else full.new_zeros(extra, *full.shape[1:])
    return torch.cat([full, pad])


class _Source:
    """The source checkpoint, read lazily: per (TP rank, stage) the model and optimizer files, memory-mapped."""

    serves_shards = False   # serves whole (TP-merged) tensors; write_layout splits them

    def __init__(self, ckpt: str, common: dict) -> None:
        args = common.get("args") or {}
        self.ckpt, self.common, self.args = ckpt, common, args
        vp = args.get("virtual_pipeline_model_parallel_size") or 1
        self.layout = layout_of(args, common["tensor_model_parallel_size"], common["pipeline_model_parallel_size"], vp)
        self.swiglu = bool(args.get("swiglu"))
        self.tied = not args.get("untie_embeddings_and_output_weights", False)
        self.has_optim = bool(common.get("has_optim", True))
        self._model: Dict[Tuple[int, int], List[Dict[str, Any]]] = {}
        self._optim: Dict[Tuple[int, int], dict] = {}
        self.model_keys: Dict[str, Tuple[int, int]] = {}    # global key -> (stage, chunk) holding it
        self.optim_keys: Dict[str, Tuple[int, int]] = {}
        for stage in range(self.layout.pp):
            for chunk, state in enumerate(self.model(0, stage)):
                for key in state:
                    self._record(self.model_keys, key, stage, chunk)
            if self.has_optim:
                for name in self.optim(0, stage)["params"]:
                    chunk, key = self._split_chunk(name)
                    self._record(self.optim_keys, key, stage, chunk)

    def _record(self, keys: Dict[str, Tuple[int, int]], key: str, stage: int, chunk: int) -> None:
        """Note where the stage-local ``key`` lives under its global name; a tied model's last-stage copy of the
        embedding is left out (reshard rules)."""
        g = global_key(key, self.layout, stage, chunk)
        if not (self.tied and self.layout.pp > 1 and _OUTPUT_WEIGHT.search(g)):
            keys.setdefault(g, (stage, chunk))

    def _split_chunk(self, name: str) -> Tuple[int, str]:
        if self.layout.vp == 1:
            return 0, name
        m = _CHUNK.match(name)
        if m is None:
            raise CheckpointError(f"{self.ckpt}: optimizer parameter {name!r} names no model chunk")
        return int(m.group(1)), m.group(2)

    def _path(self, tp_rank: int, stage: int, name: str) -> str:
        return os.path.join(self.ckpt, mp_dir_name(tp_rank, stage), name)

    def model(self, tp_rank: int, stage: int) -> List[Dict[str, Any]]:
        if (tp_rank, stage) not in self._model:
            saved = _load(self._path(tp_rank, stage, "model.pt"), mmap=True)
            self._model[tp_rank, stage] = chunk_states(saved, self.layout.vp)
        return self._model[tp_rank, stage]

    def optim(self, tp_rank: int, stage: int) -> dict:
        if (tp_rank, stage) not in self._optim:
            self._optim[tp_rank, stage] = _load(self._path(tp_rank, stage, "optim.pt"), mmap=True)
        return self._optim[tp_rank, stage]

    def _local(self, g: str, where: Tuple[int, int]) -> Tuple[int, int, str]:
        stage, chunk = where
        m = _LAYER.match(g)
        if m is None:
            return stage, chunk, g
        return stage, chunk, f"{m.group(1)}{int(m.group(2)) - self.layout.offset(stage, chunk)}{m.group(3)}"

    def _full(self, g: str, shards: List[torch.Tensor], tp_rank: Optional[int]) -> torch.Tensor:
        """TP-merged; a replicated tensor as TP rank ``tp_rank`` holds it when the TP size stays (each rank's own
        copy: nothing is assumed equal that need not be)."""
        if tp_rank is not None and tp_split_dim(g) is None:
            return shards[tp_rank]
        return merge_tp(g, shards, self.swiglu)

    def model_tensor(self, g: str, tp_rank: Optional[int] = None) -> Any:
        """The full (TP-merged) model tensor of global key ``g`` (or the non-tensor entry, e.g. ``_extra_state``)."""
        stage, chunk, key = self._local(g, self.model_keys[g])
        shards = [self.model(t, stage)[chunk][key] for t in range(self.layout.tp)]
        if not torch.is_tensor(shards[0]):
            return shards[0]
        return self._full(g, shards, tp_rank)

    def optim_entry(self, g: str, tp_rank: Optional[int] = None) -> Dict[str, Any]:
        """Global key ``g``'s optimizer entry with each state tensor full and in the parameter's shape."""
        stage, chunk, key = self._local(g, self.optim_keys[g])
        name = key if self.layout.vp == 1 else f"{chunk}.{key}"
        entries = [self.optim(t, stage)["params"][name] for t in range(self.layout.tp)]
        out: Dict[str, Any] = {}
        for field, value in entries[0].items():
            if torch.is_tensor(value):
                shape = tuple(entries[0]["shape"])
                out[field] = self._full(g, [e[field].reshape(shape) for e in entries], tp_rank)
        return out

    def optim_header(self) -> Dict[str, Any]:
        """The non-parameter part of the canonical state: type, step, loss scaler, param groups of every stage."""
        first = self.optim(0, 0)
        groups: List[dict] = []
        seen = set()
        for stage in range(self.layout.pp):
            for g in self.optim(0, stage)["param_groups"]:
                # (groups saved before they carried their overrides are told apart as the loader matches them)
                key = repr(g["overrides"] if "overrides" in g else (g.get("wd_mult"), g.get("lr_mult")))
                if key not in seen:
                    seen.add(key)
                    groups.append(g)
        return {"format": first["format"], "optimizer": first["optimizer"],
                "step": max(self.optim(0, s)["step"] for s in range(self.layout.pp)),
                "param_groups": groups, "grad_scaler": first["grad_scaler"]}


def target_vocab(args: Dict[str, Any], tp: int, divisible_by: Optional[int] = None
                 ) -> Tuple[Optional[int], Optional[int], Optional[str]]:
    """(padded rows, --make-vocab-size-divisible-by that gives them at TP ``tp``, notice or None) for the target.

    Without ``divisible_by`` the padded size is kept when ``tp`` divides it, so the model computes the same function
    (padded logits take part in the softmax); the notice then names the smallest ``--make-vocab-size-divisible-by``
    that pads to it at TP ``tp``, for the resumed run. Otherwise the vocabulary is padded by that rule.
    """
    vocab, rows, old_div = (args.get("tokenizer_vocab_size") or args.get("vocab_size"), args.get("padded_vocab_size"),
                            args.get("make_vocab_size_divisible_by"))
    if not vocab or not rows or not old_div:
        return None, None, None
    if divisible_by is None:
        if padded_vocab_size(vocab, old_div, tp) == rows:
            return rows, old_div, None
        if rows % tp == 0:
            d = next(d for d in range(1, rows // tp + 1) if (rows // tp) % d == 0
                     and padded_vocab_size(vocab, d, tp) == rows)
            return rows, d, (f"> notice: the padded vocabulary keeps its {rows} rows (tokenizer: {vocab}); at TP {tp} "
                             f"resume with --make-vocab-size-divisible-by {d} (--make-vocab-size-divisible-by "
                             f"{old_div} would pad to {padded_vocab_size(vocab, old_div, tp)}; reshard with "
                             "--target-make-vocab-size-divisible-by for that)")
        divisible_by = old_div
    new_rows = padded_vocab_size(vocab, divisible_by, tp)
    note = None
    if new_rows != rows:
        note = (f"> notice: the padded vocabulary changes from {rows} to {new_rows} rows (tokenizer: {vocab}; "
                f"--make-vocab-size-divisible-by {divisible_by} at TP {tp}): padding rows are cut, or added as "
                "copies of the last row with zero optimizer moments. Padded logits take part in the softmax, so "
                "the loss moves by the probability they held")
    return new_rows, divisible_by, note


def tp_problems(args: Dict[str, Any], tp: int) -> List[str]:
    """What megatron-core's layers need of TP ``tp`` for this model (whole heads and query groups per rank, an
    evenly split FFN): a split that only fits the shapes would cut through a query group."""
    heads = args.get("num_attention_heads") or 0
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    ffn = args.get("ffn_hidden_size") or 0
    problems = []
    for value, what in ((heads, "--num-attention-heads"), (groups, "query groups (--num-query-groups)"),
                        (ffn, "--ffn-hidden-size")):
        if value and value % tp:
            problems.append(f"{what} {value} is not divisible by it")
    return problems


def _tied_output(g: str, target: Layout, tied: bool) -> Optional[str]:
    """For a tied model at PP > 1: the embedding key whose copy the last stage's ``output_layer.weight`` is."""
    if tied and target.pp > 1 and _OUTPUT_WEIGHT.search(g):
        return g[: len(g) - len("output_layer.weight")] + "embedding.word_embeddings.weight"
    return None


def _target_keys(keys: Dict[str, Tuple[int, int]], target: Layout, tied: bool) -> Iterator[Tuple[int, int, str, str]]:
    """(stage, chunk, local key, global key) of every tensor each target position holds, in source order."""
    for g in keys:
        where, key = local_key(g, target)
        if where is not None:
            yield where[0], where[1], key, g
            continue
        for stage in range(target.pp):
            for chunk in range(target.vp):
                if target.holds(stage, chunk, g):
                    yield stage, chunk, key, g
        if tied and target.pp > 1 and re.search(r"(^|\.)embedding\.word_embeddings\.weight$", g):
            out = g[: len(g) - len("embedding.word_embeddings.weight")] + "output_layer.weight"
            yield target.pp - 1, target.vp - 1, out, out


def reshard_checkpoint(load_dir: str, save_dir: str, tp: int, pp: int, vp: Optional[int] = None,
                       divisible_by: Optional[int] = None, log: Callable[[str], None] = print,
                       split: Optional[Dict[str, Any]] = None, transformer_impl: Optional[str] = None) -> str:
    """Write ``load_dir``'s tracked checkpoint into ``save_dir`` for TP ``tp`` x PP ``pp`` (``vp`` model chunks per
    stage; default: the source's), published atomically with its own manifest. Returns the new checkpoint directory.
    ``divisible_by``: pad the vocabulary as ``--make-vocab-size-divisible-by`` would at TP ``tp`` (default: keep the
    padded size where TP ``tp`` divides it; see the reshard rules). ``split``: the target's pipeline split, all four
    of ``pipeline_layout.LAYOUT_ARGS`` (None: the source's).
    """
    if split is not None and set(split) != set(LAYOUT_ARGS):
        raise ValueError(f"split must give all of {LAYOUT_ARGS}, got {sorted(split)}")
    ckpt = find_checkpoint(load_dir)
    if ckpt is None:
        raise CheckpointError(f"--load {load_dir}: no checkpoint there")
    check_offline_target(load_dir, save_dir, "resharded")
    verify_checksums(ckpt)
    common = _load(os.path.join(ckpt, "common.pt"))
    if not isinstance(common, dict) or not str(common.get("format", "")).startswith("megatron_ext.pretrain_gpt/"):
        raise CheckpointError(f"{ckpt}: not a megatron_ext pretrain_gpt checkpoint")
    return write_layout(_Source(ckpt, common), ckpt, save_dir, tp, pp, vp, divisible_by, log, split,
                        transformer_impl)


def write_layout(src: Any, ckpt: str, save_dir: str, tp: int, pp: int, vp: Optional[int] = None,
                 divisible_by: Optional[int] = None, log: Callable[[str], None] = print,
                 split: Optional[Dict[str, Any]] = None, transformer_impl: Optional[str] = None,
                 origin: str = "resharded_from", verb: str = "resharded", note: str = "") -> str:
    """Write the model (and optimizer) state ``src`` serves by global key -- a pretrain_gpt checkpoint's
    (``_Source``) or a Megatron-LM torch_dist one's (``checkpoint_import_dist.DistSource``) -- into ``save_dir`` at
    TP ``tp`` x PP ``pp`` (see :func:`reshard_checkpoint` for the other arguments); ``src.common`` gives the rest of
    ``common.pt``, which records ``ckpt`` under ``origin``."""
    common = src.common
    args = src.args
    if src.serves_shards and src.has_optim and (tp, pp, vp) != (src.layout.tp, src.layout.pp, src.layout.vp):
        raise CheckpointError("a torch_dist checkpoint's optimizer state is imported at its saving layout; reshard "
                              "the imported checkpoint (tools/reshard_checkpoint.py) for another")
    target_args = dict(args, **(split if split is not None else {}))
    try:
        target = layout_of(target_args, tp, pp, vp or src.layout.vp)
    except ValueError as e:
        hints = []
        if vp is None and src.layout.vp > 1:
            hints.append(f"the checkpoint has {src.layout.vp} model chunks per stage: pass "
                         "--target-num-virtual-stages-per-pipeline-rank for the target")
        if split is None and not src.layout.even:
            hints.append(f"the checkpoint's pipeline split ({src.layout.flags()}) was kept: give the target's with "
                         "--target-decoder-first/last-pipeline-num-layers, --target-account-for-embedding/loss-in-"
                         "pipeline-split or --target-even-pipeline-split")
        message = str(e)
        if split is not None:   # the target's split was given on the tool's command line: name its flags
            message = re.sub(r"--(decoder-(first|last)-pipeline-num-layers|account-for-(embedding|loss)-in-pipeline-"
                             r"split)", r"--target-\1", message)
        raise CheckpointError(f"target layout: {message}{''.join(f' ({h})' for h in hints)}") from None
    problems = tp_problems(args, tp)
    if problems:
        raise CheckpointError(f"--target-tensor-parallel-size {tp} does not fit this model: " + "; ".join(problems))
    # Transformer Engine's layer names -> local ones (the import's renames), for a run without Transformer Engine
    source_impl = args.get("transformer_impl") or "local"
    renames = None
    if transformer_impl not in (None, source_impl):
        if transformer_impl != "local":
            raise CheckpointError(f"--target-transformer-impl {transformer_impl}: the checkpoint's layers are "
                                  f"{source_impl}'s; only Transformer Engine's names can be rewritten, to local ones")
        from .checkpoint_import import rename_for_local, te_to_local_names

        names = te_to_local_names()
        renames = lambda state: rename_for_local(state, names)   # noqa: E731
    if args.get("ladder_residual") or args.get("desync_residual"):
        log("> notice: a Ladder/Desynced Residual model: pipeline stages that cut through its ladder layers change "
            "where it re-syncs (see README)")
    new_rows, divisible_by, vocab_note = target_vocab(args, tp, divisible_by)
    if vocab_note:
        log(vocab_note)

    def fit_vocab(g: str, t: torch.Tensor, is_weight: bool) -> torch.Tensor:
        if new_rows is None or not _VOCAB.search(g) or t.shape[0] == new_rows:
            return t
        return resize_vocab(t, new_rows, fill_with_last_row=is_weight)

    iteration = common["iteration"]
    final = os.path.join(save_dir, iter_dir_name(iteration))
    with offline_checkpoint(save_dir, iteration) as save:
        model_plan = list(_target_keys(src.model_keys, target, src.tied))
        optim_plan = list(_target_keys(src.optim_keys, target, src.tied)) if src.has_optim else []
        header = src.optim_header() if src.has_optim else None

        # Merged again for each TP rank rather than kept: memory holds one position's state, not a stage's.
        same_tp = tp == src.layout.tp

        def full_model(g: str, t: int) -> Any:
            v = src.model_tensor(_tied_output(g, target, src.tied) or g, t if same_tp else None)
            return fit_vocab(g, v, True) if torch.is_tensor(v) else v

        def model_shard(g: str, t: int) -> Any:
            """TP rank ``t``'s shard of ``g``: read as such where the source can (a torch_dist checkpoint, whose
            reads then touch only the stored chunks it overlaps), else split from the merged tensor."""
            stored = _tied_output(g, target, src.tied) or g
            if src.serves_shards and (new_rows in (None, src.shape(stored)[0]) or not _VOCAB.search(g)):
                return src.model_shard(stored, tp, t, src.swiglu)
            v = full_model(g, t)
            return split_tp(g, v, tp, t, src.swiglu) if torch.is_tensor(v) else v

        def full_optim(g: str, t: int) -> Dict[str, torch.Tensor]:
            entry = src.optim_entry(_tied_output(g, target, src.tied) or g, t if same_tp else None)
            return {f: fit_vocab(g, v, f == "master") for f, v in entry.items()}

        for stage in range(target.pp):
            for t in range(target.tp):
                mp_dir = mp_dir_name(t, stage)
                chunks: List[Dict[str, Any]] = [{} for _ in range(target.vp)]
                for s, c, key, g in model_plan:
                    if s == stage:
                        chunks[c][key] = model_shard(g, t)
                if renames is not None:
                    chunks = [renames(chunk) for chunk in chunks]
                model = chunks[0] if target.vp == 1 else {f"model{i}": st for i, st in enumerate(chunks)}
                save(model, os.path.join(mp_dir, "model.pt"))
                del model, chunks
                if header is not None:
                    params: Dict[str, dict] = {}
                    for s, c, key, g in optim_plan:
                        if s != stage:
                            continue
                        if src.serves_shards:   # a torch_dist checkpoint's, read per position
                            shard = src.optim_shard(s, c, key, g, tp, t, src.swiglu)
                        else:
                            shard = {f: split_tp(g, v, tp, t, src.swiglu) for f, v in full_optim(g, t).items()}
                        params[key if target.vp == 1 else f"{c}.{key}"] = canonical_entry(shard)
                    if renames is not None:
                        params = renames(params)
                    save({**copy.deepcopy(header), "params": params}, os.path.join(mp_dir, "optim.pt"))
                    del params
        new_common = dict(common)
        new_args = dict(args)
        new_args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                        virtual_pipeline_model_parallel_size=target.vp if target.vp > 1 else None,
                        num_virtual_stages_per_pipeline_rank=target.vp if target.vp > 1 else None,
                        num_layers_per_virtual_pipeline_stage=None, world_size=None, data_parallel_size=None,
                        **target.split_args())
        if new_rows is not None:
            new_args.update(padded_vocab_size=new_rows, make_vocab_size_divisible_by=divisible_by)
        if renames is not None:
            new_args.update(transformer_impl="local")
        new_common.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=None,
                          data_parallel_size=None, args=new_args, **{origin: os.path.realpath(ckpt)})
        save(new_common, "common.pt")
    log(f"> {verb} {ckpt} (TP {src.layout.tp}, PP {src.layout.pp}, {src.layout.vp} chunk(s) per stage, "
        f"{src.layout.describe()}) into {final} (TP {tp}, PP {pp}, {target.vp} chunk(s) per stage, "
        f"{target.describe()}{'; layer names transformer_engine -> local' if renames is not None else ''}); "
        f"RNG states are re-seeded on resume{note}")
    return final
