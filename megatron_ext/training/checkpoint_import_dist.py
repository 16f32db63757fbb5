"""Import a Megatron-LM ``--ckpt-format torch_dist`` checkpoint (its default) as a pretrain_gpt checkpoint.

[Note: torch_dist]
Megatron-LM saves torch_dist checkpoints with megatron-core's ``dist_checkpointing``: PyTorch Distributed Checkpoint
files (``.metadata``, ``__R_I.distcp``) that hold each tensor once, under its global name and shape, whatever TP/PP/DP
saved it, and ``common.pt`` with what is not sharded (``args``, ``iteration``, the LR scheduler). The model's names
are megatron-core's ``sharded_state_dict`` keys:

* a layer's tensor is stacked over all the model's layers: ``decoder.layers.mlp.linear_fc1.weight`` has global shape
  ``[num_layers, ...]`` (the interleaved pipeline's chunks included), layer ``i`` is pretrain_gpt's
  ``decoder.layers.<i>.mlp.linear_fc1.weight`` before the pipeline split;
* the TP split is undone as the reshard rules merge it (``checkpoint_reshard.py``; a fused SwiGLU ``linear_fc1`` as
  ``[gate; up]``), and the vocabulary keeps the saving run's padding;
* the layer norms carry Transformer Engine's names whatever ``--transformer-impl`` saved them (megatron-core's local
  layer spec maps its own names to those), so ``--transformer-impl local`` renames them as the torch-format import;
* a tied model (no ``--untie-embeddings-and-output-weights``) saves the embedding only.

So the import is the reshard tool's writer (``write_layout``) reading from :class:`DistSource`: at the saving run's TP
and PP sizes and pipeline split, each position's tensors are read as one layer's slice through DCP's load planner,
which reads only the stored chunks that slice overlaps (memory holds one position's state and one layer's tensor).

Not carried: Megatron's optimizer state (``optimizer.*`` entries, in a layout of its version and sharding type:
resume with ``--no-load-optim`` or ``--finetune``, as after the torch-format import of Megatron's own optimizer), the
RNG states, and Transformer Engine's extra states (byte objects with FP8 scaling metadata: each module keeps its
own, as when a checkpoint saved without Transformer Engine loads with it).
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .checkpoint_import import _IMPLS, _read, checked_args, imported_common
from .checkpoint_reshard import _gated, layout_of, tp_split_dim, write_layout
from .checkpointing import CheckpointError

_LAYERS = "decoder.layers."
_MODEL = re.compile(r"^(embedding|decoder|output_layer)\.")
_NOT_MODEL = re.compile(r"^(optimizer|rng_state|rerun_state_machine)(\.|/|$)")
_GLOBAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_ORDER = (r"^embedding\.", r"^decoder\.layers\.", r"^decoder\.", r"^output_layer\.")


def _planner(offsets: Dict[str, Tuple[int, ...]]):
    """A DCP load planner that fills each destination tensor with the slice of its saved tensor at ``offsets``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SlicePlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            for fqn, dest in self.state_dict.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets[fqn]), sizes=dest.size())
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index):   # the destination is the slice itself, not the whole saved tensor
            return self.state_dict[index.fqn]

    return SlicePlanner()


class DistSource:
    """A torch_dist checkpoint's model tensors by pretrain_gpt's global key (the reshard writer's source)."""

    has_optim = False
    optim_keys: Dict[str, Tuple[int, int]] = {}

    def __init__(self, ckpt: str, common: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.ckpt, self.common = ckpt, common
        args = dict(common["args"], transformer_impl="transformer_engine")   # the names torch_dist stores
        self.args = args
        tp, pp = common["tensor_model_parallel_size"], common["pipeline_model_parallel_size"]
        self.layout = layout_of(args, tp, pp, args.get("virtual_pipeline_model_parallel_size") or 1)
        self.swiglu = bool(args.get("swiglu"))
        self.tied = not args.get("untie_embeddings_and_output_weights", False)
        try:
            metadata = FileSystemReader(ckpt).read_metadata()
        except Exception as e:   # noqa: BLE001 - DCP raises its own types for a damaged .metadata
            raise CheckpointError(f"{ckpt}: unreadable torch_dist metadata ({type(e).__name__}: {e})") from None
        self._saved: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}   # stored key -> (global shape, dtype)
        foreign = []
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata) or _NOT_MODEL.match(key):
                continue   # byte objects (extra states, RNG), optimizer state: see the module note
            if not _MODEL.match(key):
                foreign.append(key)
                continue
            self._saved[key] = (tuple(md.size), md.properties.dtype)
        if foreign:
            raise CheckpointError(f"{ckpt}: tensors pretrain_gpt's GPT model has no place for: {', '.join(foreign[:4])}"
                                  f"{' ...' if len(foreign) > 4 else ''}")
        if not any(k.startswith(_LAYERS) for k in self._saved):
            raise CheckpointError(f"{ckpt}: no decoder layer tensors (decoder.layers.*) among the saved tensors")
        self.model_keys: Dict[str, Tuple[int, int]] = {}
        num_layers = args["num_layers"]
        for key in self._saved:
            shape = self._saved[key][0]
            if key.startswith(_LAYERS):
                if not shape or shape[0] != num_layers:
                    raise CheckpointError(f"{ckpt}: {key} has shape {shape}, not stacked over the --num-layers "
                                          f"{num_layers} layers (a layer structure pretrain_gpt does not build)")
                for i in range(num_layers):
                    self.model_keys[f"{_LAYERS}{i}.{key[len(_LAYERS):]}"] = (0, 0)
            elif not (self.tied and key == "output_layer.weight"):   # (written from the embedding where needed)
                self.model_keys[key] = (0, 0)
        self.model_keys = dict(sorted(self.model_keys.items(), key=lambda kv: _layer_order(kv[0])))

    def model_tensor(self, g: str, tp_rank: Optional[int] = None) -> torch.Tensor:
        """The full (TP-merged) tensor of global key ``g``, read from the checkpoint."""
        return self._read(g, [])

    def model_shard(self, g: str, tp: int, rank: int, swiglu: bool) -> torch.Tensor:
        """TP rank ``rank``'s shard of ``g`` at TP ``tp``, bit for bit ``split_tp`` of :meth:`model_tensor`, read
        as just that slice (at the saving run's TP size, its own stored chunk) rather than the whole tensor."""
        dim = tp_split_dim(g)
        if dim is None or tp == 1:
            return self._read(g, [])
        size = self.shape(g)[dim]
        parts = 2 if _gated(g, swiglu) else 1   # a fused SwiGLU fc1: the rank's rows of the gate, then of the up
        if size % (parts * tp):
            raise CheckpointError(f"{g}: dim {dim} of shape {self.shape(g)} does not split over TP {tp}")
        n = size // (parts * tp)
        return torch.cat([self._read(g, [(dim, part * size // parts + rank * n, n)]) for part in range(parts)],
                         dim=dim)

    def _stored(self, g: str) -> Tuple[str, Optional[int]]:
        """(stored key, layer index or None) of global key ``g``."""
        m = _GLOBAL_LAYER.match(g)
        return (f"{_LAYERS}{m.group(2)}", int(m.group(1))) if m else (g, None)

    def shape(self, g: str) -> Tuple[int, ...]:
        """The global shape of ``g`` (one layer's, for a layer tensor)."""
        key, layer = self._stored(g)
        shape = self._saved[key][0]
        return shape if layer is None else shape[1:]

    def _read(self, g: str, narrow: List[Tuple[int, int, int]]) -> torch.Tensor:
        """``g`` narrowed by each ``(dim, start, length)``, read through DCP's planner from the stored chunks it
        overlaps."""
        from torch.distributed.checkpoint import FileSystemReader, load

        key, layer = self._stored(g)
        sizes, offsets = list(self.shape(g)), [0] * len(self.shape(g))
        for dim, start, length in narrow:
            offsets[dim], sizes[dim] = start, length
        if layer is not None:
            sizes, offsets = [1, *sizes], [layer, *offsets]
        dest = torch.empty(sizes, dtype=self._saved[key][1])
        with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore")
            load({key: dest}, storage_reader=FileSystemReader(self.ckpt), planner=_planner({key: tuple(offsets)}),
                 no_dist=True)
        return dest if layer is None else dest[0]


def _layer_order(g: str) -> Tuple[int, int]:
    """State-dict order: embedding, layers by index, final norm, output layer."""
    m = _GLOBAL_LAYER.match(g)
    return next(i for i, p in enumerate(_ORDER) if re.match(p, g)), int(m.group(1)) if m else -1


def import_torch_dist(ckpt: str, save_dir: str, transformer_impl: Optional[str],
                      log: Callable[[str], None] = print) -> str:
    """Write Megatron-LM's torch_dist checkpoint ``ckpt`` into ``save_dir`` as a pretrain_gpt checkpoint at the
    saving run's TP/PP sizes (the target already checked by the caller); returns the new checkpoint directory."""
    common_path = os.path.join(ckpt, "common.pt")
    if not os.path.isfile(common_path):
        raise CheckpointError(f"{ckpt}: no common.pt (an incomplete torch_dist save?)")
    saved = _read(common_path)
    args = checked_args(saved, common_path)
    source_impl = args.get("transformer_impl") or "transformer_engine"
    target_impl = transformer_impl or source_impl
    if target_impl not in _IMPLS:
        raise CheckpointError(f"--transformer-impl {target_impl}: choose one of {', '.join(_IMPLS)}")
    step = 0 if os.path.basename(ckpt) == "release" else int(saved.get("iteration", 0))
    common = imported_common(saved, args, step, False, ckpt, target_impl)
    src = DistSource(ckpt, common)
    layout = src.layout
    return write_layout(src, ckpt, save_dir, layout.tp, layout.pp, layout.vp, log=log,
                        transformer_impl=target_impl, origin="imported_from",
                        verb="imported Megatron-LM's torch_dist checkpoint",
                        note="; no optimizer state (Megatron's own): resume with --no-load-optim, or --finetune")
