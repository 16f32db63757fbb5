"""Train/valid/test data for pretrain_gpt through megatron-core's GPTDataset, and a resumable batch order.

[Note: data position]
Samples are drawn like Megatron-LM's ``MegatronPretrainingSampler``: the global sample order is fixed by the
dataset (megatron-core's shuffled sample index); iteration ``i`` consumes global samples
``[consumed, consumed + global_batch)``, cut into micro-batches of ``micro_batch * dp`` consecutive samples of which
DP rank ``r`` takes slice ``r``. The only state is ``consumed_samples``, which checkpoints store, so a resumed run
(at any DP size, for the same global batch) sees exactly the samples it would have seen.

[Note: megatron-core's C++ helper]
GPTDataset builds its sample index with ``megatron.core.datasets.helpers_cpp``. The megatron-core 0.16 wheel ships it
compiled (checked: ``helpers_cpp.cpython-311-x86_64-linux-gnu.so``), so nothing is compiled on CPU machines.
Megatron-LM checkouts compile it at run time with ``make`` (``compile_helpers``); we fall back to that only when the
compiled module is missing, on one rank before the others build their datasets.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, Iterator, List, Optional

import torch

logger = logging.getLogger(__name__)


def ensure_dataset_helpers() -> None:
    """Make ``megatron.core.datasets.helpers`` importable (see the note above); errors say what to install."""
    try:
        from megatron.core.datasets import helpers  # noqa: F401
        return
    except ImportError:
        pass
    from megatron.core.datasets.utils import compile_helpers

    logger.warning("megatron-core's compiled dataset helpers are missing; compiling them with make (needs g++ and "
                   "pybind11)")
    compile_helpers()
    from megatron.core.datasets import helpers  # noqa: F401,F811


def train_valid_test_num_samples(train_iters: int, global_batch_size: int, eval_interval: int,
                                 eval_iters: int, train_samples: Optional[int] = None) -> List[int]:
    """Megatron-LM's sizing: enough samples for all training (``--train-samples`` when given, as Megatron-LM builds
    its dataset for them, which fixes the shuffle), all evaluations, and one final evaluation."""
    evals = (train_iters // eval_interval + 1) * eval_iters if eval_iters > 0 else 0
    train = train_samples if train_samples is not None else train_iters * global_batch_size
    return [train, evals * global_batch_size, eval_iters * global_batch_size]


def build_datasets(data_prefix: List[str], split: str, seq_length: int, seed: int, tokenizer, num_samples: List[int],
                   mock: bool = False, cache_dir: Optional[str] = None, eod_mask_loss: bool = False,
                   reset_position_ids: bool = False, per_split: Optional[List[Optional[List[str]]]] = None
                   ) -> List[Optional[torch.utils.data.Dataset]]:
    """(train, valid, test) GPTDatasets from a ``--data-path`` blend and ``--split``, or from ``per_split`` blends
    (``--train-data-path`` ...: each split's files whole, megatron-core's ``blend_per_split``), via megatron-core's
    builder (``--eod-mask-loss`` and ``--reset-position-ids`` are its options of the same names)."""
    ensure_dataset_helpers()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.utils import get_blend_from_list

    blend, blend_per_split = None, None
    if per_split is not None:
        split = None
        blend_per_split = [get_blend_from_list(p) if p else None for p in per_split]
    elif not mock:
        _check_files(_prefixes(data_prefix))
        split = usable_split(_prefixes(data_prefix), split, num_samples)
        blend = get_blend_from_list(data_prefix)
    else:
        split = ",".join(f"{w:g}" for w in parse_split(split))
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=blend, blend_per_split=blend_per_split,
        split=split, path_to_cache=cache_dir, tokenizer=tokenizer, reset_position_ids=reset_position_ids,
        reset_attention_mask=False, eod_mask_loss=eod_mask_loss, create_attention_mask=False,
        mid_level_dataset_surplus=0.005)
    cls = MockGPTDataset if mock else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, num_samples, lambda: True, config).build()


SPLIT_NAMES = ("train", "validation", "test")


def parse_split(split: str) -> List[float]:
    """``--split`` as three non-negative weights (train, validation, test); missing trailing entries are 0.

    Megatron-LM's rule (``99,1`` means ``99,1,0``), but strict: megatron-core's own parser keeps only the digits of
    each entry (``-1`` becomes ``1``) and divides by zero for ``0,0,0``, so bad values are an error naming the flag
    here, raised while the flags are validated, before any process group exists.
    """
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    if not 1 <= len(parts) <= len(SPLIT_NAMES):
        raise ValueError(f"--split {split!r}: expected 1 to 3 comma-separated weights (train,validation,test)")
    weights = []
    for p in parts:
        try:
            w = float(p)
        except ValueError:
            raise ValueError(f"--split {split!r}: {p!r} is not a number") from None
        if not (w >= 0.0 and w != float("inf")):
            raise ValueError(f"--split {split!r}: weights must be finite and non-negative, got {p!r}")
        weights.append(w)
    weights += [0.0] * (len(SPLIT_NAMES) - len(weights))
    if weights[0] == 0.0:
        raise ValueError(f"--split {split!r} gives the train split no data")
    return weights


def _check_files(prefixes: List[str], flag: str = "--data-path") -> None:
    for p in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(p + ext):
                raise FileNotFoundError(f"{flag} {p}: missing {p + ext} (pass the prefix without .bin/.idx; "
                                        "make one with tools/preprocess_data.py)")


def check_data_path(data_prefix: List[str], split: str, eval_iters: int, what: str = "--data-path") -> Optional[str]:
    """The ``--data-path`` / ``--split`` checks of :func:`build_datasets`, made while the flags are validated (before
    any process group): missing files and a needed split left empty are errors (``FileNotFoundError`` /
    ``ValueError`` naming the flag); returns a notice naming the splits that get no documents, or None."""
    prefixes = _prefixes(data_prefix)
    _check_files(prefixes)
    usable = parse_split(usable_split(prefixes, split, [1, eval_iters, eval_iters]))
    dropped = [SPLIT_NAMES[i] for i, (w, u) in enumerate(zip(parse_split(split), usable)) if w > 0 and u == 0]
    if not dropped:
        return None
    return (f"> --split {split} leaves the {' and '.join(dropped)} split{'s' if len(dropped) > 1 else ''} of "
            f"{what} without documents: not evaluated there")


def usable_split(prefixes: List[str], split: str, num_samples: List[int]) -> str:
    """``split`` (as three weights) with the weight of any split that would get no documents set to 0.

    megatron-core's GPTDataset loops forever computing epochs for a split with zero tokens, which a small corpus
    hits easily (``969,30,1`` of 300 documents leaves the test split empty). An empty split that the run needs
    (train, or valid with ``--eval-iters`` > 0) is an error naming ``--split``.
    """
    from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix

    weights = parse_split(split)
    total = sum(weights)
    matrix = convert_split_vector_to_split_matrix([w / total for w in weights])
    for prefix in prefixes:
        n = _documents(prefix, "--data-path")
        for i, bounds in enumerate(matrix):
            if weights[i] == 0 or bounds is None:
                continue
            a, b = bounds
            if int(round(b * n)) - int(round(a * n)) == 0:
                if i == 0 or (i == 1 and num_samples[1] > 0):
                    raise ValueError(f"--split {split} leaves the {SPLIT_NAMES[i]} split of {prefix} ({n} documents) "
                                     f"empty; choose another --split" + (" or --eval-iters 0" if i == 1 else ""))
                weights[i] = 0.0
    return ",".join(f"{w:g}" for w in weights)


def _documents(prefix: str, flag: str) -> int:
    """The documents of ``prefix``'s dataset, after checking that its .bin holds what its .idx indexes (a truncated
    copy would fail at some sample, naming nothing)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    n = len(ds)
    if n:
        need = int(ds.index.sequence_pointers[-1]) + int(ds.index.sequence_lengths[-1]) * ds.index.dtype_size
        have = os.path.getsize(prefix + ".bin")
        if have < need:
            raise ValueError(f"{flag} {prefix}: {prefix}.bin holds {have} bytes but its .idx indexes {need} "
                             "(a truncated or mismatched .bin)")
    return n


def check_per_split_paths(paths: List[Optional[List[str]]], eval_iters: int) -> Optional[str]:
    """:func:`check_data_path` for ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``: missing
    files, truncated ones and empty datasets (megatron-core would loop forever over zero tokens) are errors naming the
    flag; returns a notice when the run evaluates (``eval_iters`` > 0) but has no validation data, or None."""
    for name, blend in zip(("--train-data-path", "--valid-data-path", "--test-data-path"), paths):
        _check_files(_prefixes(blend or []), name)
        for prefix in _prefixes(blend or []):
            try:
                documents = _documents(prefix, name)
            except AssertionError as e:   # megatron-core's IndexedDataset on a corrupt .idx
                raise ValueError(f"{name} {prefix}: its index file is not a megatron-core .idx ({e})") from None
            if documents == 0:
                raise ValueError(f"{name} {prefix}: the dataset holds no documents")
    if eval_iters > 0 and not paths[1]:
        return "> no --valid-data-path: no validation during training"
    return None


def _prefixes(data_prefix: List[str]) -> List[str]:
    """The path entries of a ``--data-path`` list that may interleave weights (``w1 p1 w2 p2``)."""
    if len(data_prefix) % 2 == 0 and len(data_prefix) > 1:
        try:
            float(data_prefix[0])
            return data_prefix[1::2]
        except ValueError:
            pass
    return data_prefix


class MicroBatchIterator:
    """Yields this DP rank's micro-batches in the global order of the note above, from ``consumed_samples`` on."""

    def __init__(self, dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
        self.dataset = dataset
        self.consumed = consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        n = len(self.dataset)
        start = self.consumed + self.dp_rank * self.mbs
        self.consumed += self.mbs * self.dp_size
        # Wrap around like megatron-core's datasets do when asked for more samples than built (eval repeats).
        samples = [self.dataset[(start + j) % n] for j in range(self.mbs)]
        return _collate(samples)


def _collate(samples: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    out = {}
    for k in samples[0]:
        vals = [s[k] for s in samples]
        if vals[0] is None:
            continue
        out[k] = torch.stack([torch.as_tensor(v) for v in vals])
    return out
