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

Megatron's optimizer state (``optimizer.*``) is carried, with the LR schedule: the DistributedOptimizer's in both of
its torch_dist layouts, the non-distributed optimizers' (model space, as ``fully_reshardable``) too
(``checkpoint_import_optim.py``); chained optimizers' are not (resume with ``--no-load-optim`` or ``--finetune``).
Not carried either: the RNG states, and Transformer Engine's extra states (byte objects with FP8 scaling metadata:
each module keeps its own, as when a checkpoint saved without Transformer Engine loads with it).
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .checkpoint_import import _IMPLS, _lenient_pickle, _read, checked_args, imported_common
from .checkpoint_import_optim import MODEL_GROUPS, MegatronOptimizerState, optimizer_label, saved_layout
from .checkpoint_reshard import _gated, _target_keys, layout_of, tp_split_dim, write_layout
from .checkpointing import CheckpointError

_LAYERS = "decoder.layers."
_MODEL = re.compile(r"^(embedding|decoder|output_layer)\.")
_NOT_MODEL = re.compile(r"^(optimizer|rng_state|rerun_state_machine)(\.|/|$)")
_GLOBAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_PER_LAYER = re.compile(r"^decoder\.layers\.\d+\.")   # layers saved one by one (megatron-core's heterogeneous)


def _reader(ckpt: str):
    """torch's DCP reader of ``ckpt`` with its ``.metadata`` read once (``load`` asks for it on every call, and a
    large save's metadata runs to many MB)."""
    from torch.distributed.checkpoint import FileSystemReader

    class CachedReader(FileSystemReader):
        _metadata = None

        def read_metadata(self):
            if self._metadata is None:
                self._metadata = super().read_metadata()
            return self._metadata

    return CachedReader(ckpt)


def _planner(reads: Dict[str, List[Tuple[Tuple[int, ...], torch.Tensor]]]):
    """A DCP load planner that fills each destination tensor with the block of its saved tensor at its offsets:
    ``{fqn: [(offsets, destination), ...]}``, several blocks of one tensor in one load."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SlicePlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            for fqn, blocks in reads.items():
                chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=dest.size()) for o, dest in blocks]
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)
            return LoadPlan(items)

        def lookup_tensor(self, index):   # the destination is the block itself, not the whole saved tensor
            return reads[index.fqn][index.index][1]

    return SlicePlanner()


class TorchDistFiles:
    """What a torch_dist checkpoint directory stores, read in place through DCP: every tensor's global shape and
    dtype, any range of a flat tensor, the byte objects (megatron-core's ShardedObjects)."""

    def __init__(self, ckpt: str) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.ckpt = ckpt
        self._reader = _reader(ckpt)
        try:
            metadata = self._reader.read_metadata()
        except Exception as e:   # noqa: BLE001 - DCP raises its own types for a damaged .metadata
            raise CheckpointError(f"{ckpt}: unreadable torch_dist metadata ({type(e).__name__}: {e})") from None
        self._chunks = {k: md.chunks for k, md in metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata)}
        # stored key -> (global shape, dtype) of every tensor; the byte objects' keys (extra states, RNG, the
        # optimizer's param groups: "<key>/shard_<offset>_<shape>")
        self._saved: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
        self._objects: Dict[str, str] = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                self._saved[key] = (tuple(md.size), md.properties.dtype)
            else:
                self._objects.setdefault(key.split("/shard_")[0], key)

    def stored_keys(self, prefix: str) -> List[str]:
        """Every stored tensor's name that starts with ``prefix``."""
        return [k for k in self._saved if k.startswith(prefix)]

    def has_stored(self, key: str) -> bool:
        return key in self._saved

    def stored_shape(self, key: str) -> Tuple[int, ...]:
        return self._saved[key][0]

    def stored_dtype(self, key: str) -> torch.dtype:
        return self._saved[key][1]

    def has_object(self, key: str) -> bool:
        return key in self._objects

    def read_object(self, key: str) -> Any:
        """A byte object megatron-core saved under ``key`` (a ShardedObject: the value of its one shard)."""
        import io

        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        if key not in self._objects:
            raise CheckpointError(f"{self.ckpt}: no {key} saved")

        got: Dict[str, Any] = {}

        class Lenient(DefaultLoadPlanner):   # another version's classes in a pickled value stay readable
            def load_bytes(self, read_item, value: io.BytesIO) -> None:
                got[read_item.dest_index.fqn] = torch.load(value, weights_only=False, pickle_module=_lenient_pickle)

        self._load({self._objects[key]: io.BytesIO()}, Lenient(), key)
        value = got[self._objects[key]]
        return value[0] if isinstance(value, list) and len(value) == 1 else value

    def read_ranges(self, ranges: Dict[str, List[Tuple[int, int]]]) -> Dict[str, List[torch.Tensor]]:
        """Elements ``[start, end)`` of stored flat tensors, ``{key: [(start, end), ...]}``, in one read from the
        stored chunks they overlap."""
        reads = {key: [((start,), torch.empty(end - start, dtype=self._saved[key][1])) for start, end in spans]
                 for key, spans in ranges.items() if spans}
        if reads:
            self._load({key: blocks[0][1] for key, blocks in reads.items()}, _planner(reads),
                       ", ".join(sorted(reads)[:2]) + (" ..." if len(reads) > 2 else ""))
        return {key: [dest for _, dest in reads.get(key, [])] for key in ranges}

    def _load(self, state: Dict[str, Any], planner: Any, what: str) -> None:
        from torch.distributed.checkpoint import load

        try:
            with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore")
                load(state, storage_reader=self._reader, planner=planner, no_dist=True)
        except Exception as e:   # noqa: BLE001 - DCP wraps a damaged or missing file in its own exception types
            raise CheckpointError(f"{self.ckpt}: cannot read {what} ({type(e).__name__}: {str(e)[:300]})") from None


class DistSource(TorchDistFiles):
    """A torch_dist checkpoint's model tensors by pretrain_gpt's global key, and its DistributedOptimizer state where
    it has one this import reads (``checkpoint_import_optim.py``): the reshard writer's source."""

    serves_shards = True   # reads a TP rank's shard itself (model_shard, optim_shard): see write_layout

    def __init__(self, ckpt: str, common: Dict[str, Any], saved: Optional[Dict[str, Any]] = None,
                 saved_impl: str = "transformer_engine") -> None:
        super().__init__(ckpt)
        self.common, self.saved_impl = common, saved_impl
        args = dict(common["args"], transformer_impl="transformer_engine")   # the names torch_dist stores
        self.args = args
        tp, pp = common["tensor_model_parallel_size"], common["pipeline_model_parallel_size"]
        self.layout = layout_of(args, tp, pp, args.get("virtual_pipeline_model_parallel_size") or 1)
        self.swiglu = bool(args.get("swiglu"))
        self.tied = not args.get("untie_embeddings_and_output_weights", False)
        model = self.model_stored_keys()
        foreign = [k for k in model if not _MODEL.match(k)]
        if foreign:
            raise CheckpointError(f"{ckpt}: tensors pretrain_gpt's GPT model has no place for: {', '.join(foreign[:4])}"
                                  f"{' ...' if len(foreign) > 4 else ''}")
        if not any(k.startswith(_LAYERS) for k in model):
            raise CheckpointError(f"{ckpt}: no decoder layer tensors (decoder.layers.*) among the saved tensors")
        per_layer = [k for k in model if _PER_LAYER.match(k)]
        if per_layer:
            raise CheckpointError(f"{ckpt}: layers saved one by one ({per_layer[0]}: heterogeneous layers), not the "
                                  "stacked layers of the GPT model pretrain_gpt builds")
        num_layers = args.get("num_layers")
        if not num_layers:
            raise CheckpointError(f"{ckpt}: its args have no num_layers")
        self._check_tp_splits(model, tp)
        self.model_keys: Dict[str, Tuple[int, int]] = {}
        for key in model:
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
        self.optim_keys: Dict[str, Tuple[int, int]] = {}
        self.has_optim, self.optim_note, self._optim = False, "", None
        optim_layout, self.optim_note = saved_layout(saved or {})
        self.optim_layout = optim_layout
        if optim_layout is not None:
            positions = list(_target_keys(self.model_keys, self.layout, self.tied))
            self._optim = MegatronOptimizerState(self, saved, optim_layout, positions)
            # the canonical state names parameters as the optimizer sees them: Float16Module's under bf16/fp16
            self._optim_prefix = "module." if args.get("bf16") or args.get("fp16") else ""
            self.has_optim = True
            self.optim_keys = {self._optim_prefix + k: v for k, v in self.model_keys.items()}

    def _check_tp_splits(self, model: List[str], tp: int) -> None:
        """Each model tensor is split across the saving run's TP ranks along the dim the reshard rules give it
        (``tp_split_dim``), or not at all: its stored chunks show how it was saved. A tensor-parallel tensor these
        rules do not know would otherwise be handed whole to every rank."""
        if tp == 1:
            return
        for key in model:
            skip = 1 if key.startswith(_LAYERS) else 0   # the layer axis
            split = {d for d in range(skip, len(self._saved[key][0]))
                     if len({c.offsets[d] for c in self._chunks[key]}) > 1}
            name = f"{_LAYERS}0.{key[len(_LAYERS):]}" if skip else key
            dim = tp_split_dim(name)
            want = set() if dim is None else {dim + skip}
            if split != want:
                raise CheckpointError(f"{self.ckpt}: {key} was saved split along dims {sorted(split) or 'none'} "
                                      f"across its TP {tp} ranks, not as the reshard rules split it ({dim}): a "
                                      "tensor-parallel parameter they do not know")

    def model_stored_keys(self) -> List[str]:
        """The stored names of the model's tensors."""
        return [k for k in self._saved if not _NOT_MODEL.match(k)]

    def stored_key(self, g: str) -> str:
        """The stored tensor global key ``g`` is read from (a layer's: the tensor stacked over the layers)."""
        return self._stored(g)[0]

    def stored_name(self, g: str) -> str:
        """The stored name of global key ``g``: a tied model's output layer is stored as its embedding."""
        if self.tied and g.endswith("output_layer.weight"):
            return g[: len(g) - len("output_layer.weight")] + "embedding.word_embeddings.weight"
        return g

    def read_flat(self, key: str) -> torch.Tensor:
        """The whole stored tensor ``key``."""
        return self._read(key, [])

    def optim_header(self) -> Dict[str, Any]:
        return self._optim.header

    def optim_shard(self, stage: int, chunk: int, key: str, g: str, tp: int, rank: int, swiglu: bool
                    ) -> Dict[str, torch.Tensor]:
        """TP rank ``rank``'s (master, exp_avg, exp_avg_sq) of the parameter ``key`` of (stage, chunk) at the saving
        layout (global key ``g``; both as :attr:`optim_keys` name them), in the parameter's shape."""
        n = len(self._optim_prefix)
        return self._optim.shard(stage, chunk, key[n:], self.stored_name(g[n:]), tp, rank, swiglu)

    def model_tensor(self, g: str, tp_rank: Optional[int] = None) -> torch.Tensor:
        """The full (TP-merged) tensor of global key ``g``, read from the checkpoint."""
        return self._read(g, [])

    def model_shard(self, g: str, tp: int, rank: int, swiglu: bool, prefix: str = "") -> torch.Tensor:
        """TP rank ``rank``'s shard of ``g`` at TP ``tp``, bit for bit ``split_tp`` of :meth:`model_tensor`, read
        as just that slice (at the saving run's TP size, its own stored chunk) rather than the whole tensor.
        ``prefix``: read the tensor stored as ``prefix + g``'s stored name instead (model-space optimizer state)."""
        dim = tp_split_dim(g)
        if dim is None or tp == 1:
            return self._read(g, [], prefix)
        size = self.shape(g, prefix)[dim]
        parts = 2 if _gated(g, swiglu) else 1   # a fused SwiGLU fc1: the rank's rows of the gate, then of the up
        if size % (parts * tp):
            raise CheckpointError(f"{g}: dim {dim} of shape {self.shape(g, prefix)} does not split over TP {tp}")
        n = size // (parts * tp)
        return torch.cat([self._read(g, [(dim, part * size // parts + rank * n, n)], prefix)
                          for part in range(parts)], dim=dim)

    def _stored(self, g: str, prefix: str = "") -> Tuple[str, Optional[int]]:
        """(stored key, layer index or None) of global key ``g``."""
        m = _GLOBAL_LAYER.match(g)
        return (f"{prefix}{_LAYERS}{m.group(2)}", int(m.group(1))) if m else (prefix + g, None)

    def shape(self, g: str, prefix: str = "") -> Tuple[int, ...]:
        """The global shape of ``g`` (one layer's, for a layer tensor)."""
        key, layer = self._stored(g, prefix)
        if key not in self._saved:
            raise CheckpointError(f"{self.ckpt}: no {key} saved")
        shape = self._saved[key][0]
        return shape if layer is None else shape[1:]

    def _read(self, g: str, narrow: List[Tuple[int, int, int]], prefix: str = "") -> torch.Tensor:
        """``g`` narrowed by each ``(dim, start, length)``, read through DCP's planner from the stored chunks it
        overlaps."""
        key, layer = self._stored(g, prefix)
        shape = self.shape(g, prefix)
        sizes, offsets = list(shape), [0] * len(shape)
        for dim, start, length in narrow:
            offsets[dim], sizes[dim] = start, length
        if layer is not None:
            sizes, offsets = [1, *sizes], [layer, *offsets]
        dest = torch.empty(sizes, dtype=self._saved[key][1])
        self._load({key: dest}, _planner({key: [(tuple(offsets), dest)]}), key)
        return dest if layer is None else dest[0]


def _layer_order(g: str) -> Tuple[int, int]:
    """State-dict order: embedding, layers by index, final norm, output layer."""
    m = _GLOBAL_LAYER.match(g)
    return next(i for i, p in enumerate(MODEL_GROUPS) if re.search(p, g)), int(m.group(1)) if m else -1


def import_torch_dist(ckpt: str, save_dir: str, transformer_impl: Optional[str],
                      log: Callable[[str], None] = print, load_optim: bool = True) -> str:
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
    src = DistSource(ckpt, common, saved if load_optim else {"optimizer": "--no-load-optim"}, source_impl)
    common["has_optim"] = src.has_optim
    layout = src.layout
    note = (f"; {optimizer_label(src.optim_layout)} state and LR schedule carried" if src.has_optim else
            f"; no optimizer state ({src.optim_note}): resume with --no-load-optim, or --finetune")
    return write_layout(src, ckpt, save_dir, layout.tp, layout.pp, layout.vp, log=log,
                        transformer_impl=target_impl, origin="imported_from",
                        verb="imported Megatron-LM's torch_dist checkpoint", note=note)
