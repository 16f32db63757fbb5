"""Which transformer layers each pipeline stage and model chunk holds, by megatron-core's rule.

megatron-core places the layers (``get_transformer_layer_offset`` / ``get_num_layers_to_build``) and Megatron-LM's
flags choose how: evenly, with ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``
(uneven first and last stages, the rest even), or with ``--account-for-embedding-in-pipeline-split`` /
``--account-for-loss-in-pipeline-split`` (the embedding / loss counted as one layer of the first / last stage).
The flag checks, the checkpoint's layout check and the reshard tool all need the same map, so it is computed here
once; ``tests/unit_tests/training/test_pipeline_layout.py`` holds it to megatron-core's functions.

In layer *slots* (a stage's layers, plus one for an embedding or loss it accounts for) every stage's slots split
evenly into its ``vp`` chunks, and the global order is chunk-major: chunk ``c`` of stage ``s`` starts after all
stages' chunks ``< c`` and stage ``< s``'s chunk ``c``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
EMBEDDING, LOSS = "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"

# The Megatron-LM argument names of the four flags (argparse dests; also the keys a checkpoint's args hold).
LAYOUT_ARGS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
               "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


class PipelineLayout:
    """The layers of a ``num_layers`` model over ``pp`` stages of ``vp`` model chunks each. Bad sizes raise
    ValueError naming the flags."""

    def __init__(self, num_layers: int, pp: int, vp: int = 1, first: Optional[int] = None,
                 last: Optional[int] = None, account_for_embedding: bool = False,
                 account_for_loss: bool = False) -> None:
        if pp < 1 or vp < 1:
            raise ValueError(f"parallel sizes must be at least 1 (PP {pp}, chunks {vp})")
        if vp > 1 and pp < 2:
            raise ValueError("several model chunks per stage need a pipeline of at least 2 stages")
        self.num_layers, self.pp, self.vp = num_layers, pp, vp
        self.first, self.last = first, last
        self.account_for_embedding, self.account_for_loss = bool(account_for_embedding), bool(account_for_loss)
        slots = self._stage_slots()
        for s, n in enumerate(slots):
            if n % vp:
                raise ValueError(f"pipeline stage {s} holds {n} layer{'s' if n != 1 else ''}"
                                 f"{self._slot_note()}, not divisible by its {vp} model chunks "
                                 "(--num-virtual-stages-per-pipeline-rank)")
        per_chunk = [n // vp for n in slots]
        emb, loss = int(self.account_for_embedding), int(self.account_for_loss)
        self._counts: Dict[Tuple[int, int], int] = {}
        self._offsets: Dict[Tuple[int, int], int] = {}
        for c in range(vp):
            for s in range(pp):
                # (0 where a chunk's one slot is the embedding or the loss: Megatron-LM's standalone stages)
                count = per_chunk[s] - (emb if (s, c) == (0, 0) else 0) - (loss if (s, c) == (pp - 1, vp - 1) else 0)
                self._counts[s, c] = count
                self._offsets[s, c] = c * sum(per_chunk) + sum(per_chunk[:s]) - (emb if (s, c) != (0, 0) else 0)
        self._where = {self._offsets[sc] + j: (*sc, j) for sc, n in self._counts.items() for j in range(n)}

    @classmethod
    def from_args(cls, args: Any, pp: int, vp: Optional[int] = None) -> "PipelineLayout":
        """From pretrain_gpt's arguments (a Namespace or a checkpoint's args dict); missing layout flags are the
        even default (checkpoints saved before they existed)."""
        get = args.get if isinstance(args, dict) else (lambda k, d=None: getattr(args, k, d))
        first, last, emb, loss = (get(k) for k in LAYOUT_ARGS)
        return cls(get("num_layers"), pp, vp or get("virtual_pipeline_model_parallel_size") or 1,
                   first, last, bool(emb), bool(loss))

    def flags(self) -> str:
        """The split flags this layout was given, as typed (or 'the even split')."""
        given = [f"{FIRST} {self.first}" if self.first is not None else "",
                 f"{LAST} {self.last}" if self.last is not None else "",
                 EMBEDDING if self.account_for_embedding else "", LOSS if self.account_for_loss else ""]
        return ", ".join(g for g in given if g) or "the even split"

    def _slot_note(self) -> str:
        return " (the embedding / loss counted as layers)" if self.account_for_embedding or self.account_for_loss \
            else ""

    def _stage_slots(self) -> List[int]:
        """Layer slots per stage, checked as megatron-core's TransformerConfig checks them."""
        L, pp = self.num_layers, self.pp
        uneven = self.first is not None or self.last is not None
        if uneven and (self.account_for_embedding or self.account_for_loss):
            raise ValueError(f"{FIRST}/{LAST} conflict with {EMBEDDING}/{LOSS}: choose one way to split the pipeline")
        if uneven:
            if pp < 2:
                raise ValueError(f"{FIRST}/{LAST} need --pipeline-model-parallel-size > 1")
            for flag, n in ((FIRST, self.first), (LAST, self.last)):
                if n is not None and n < 1:
                    raise ValueError(f"{flag} must be positive, got {n}")
            middle_layers = L - (self.first or 0) - (self.last or 0)
            if middle_layers < 0:
                raise ValueError(f"{self.flags()} place more layers than --num-layers {L}")
            middle_stages = pp - (self.first is not None) - (self.last is not None)
            if bool(middle_layers) != bool(middle_stages) or (
                    middle_stages and middle_layers % middle_stages):
                raise ValueError(
                    f"--num-layers {L} with {self.flags()} leaves {middle_layers} layers for the "
                    f"{middle_stages} other pipeline stage{'s' if middle_stages != 1 else ''} of "
                    f"--pipeline-model-parallel-size {pp}: they must split evenly (and none may be left without "
                    "a stage)")
            if self.vp > 1 and not middle_stages:   # megatron-core 0.16 divides by the middle stages then
                raise ValueError(f"{FIRST} and {LAST} together with --num-virtual-stages-per-pipeline-rank need "
                                 "--pipeline-model-parallel-size > 2 (megatron-core places interleaved chunks "
                                 "through the stages between them)")
            per = middle_layers // middle_stages if middle_stages else 0
            slots = [per] * pp
            if self.first is not None:
                slots[0] = self.first
            if self.last is not None:
                slots[-1] = self.last
            return slots
        total = L + self.account_for_embedding + self.account_for_loss
        if total % pp:
            counted = f" + {total - L} for {self.flags()}" if total > L else ""
            raise ValueError(f"--num-layers ({L}{counted}) must be divisible by --pipeline-model-parallel-size ({pp})")
        return [total // pp] * pp

    @property
    def even(self) -> bool:
        """Whether no split flag was given (the plain even split; flags that happen to place the layers evenly still
        count as given, since they mean something else at another PP size)."""
        return self.first is None and self.last is None and not (self.account_for_embedding or
                                                                  self.account_for_loss)

    def count(self, stage: int, chunk: int = 0) -> int:
        return self._counts[stage, chunk]

    def offset(self, stage: int, chunk: int = 0) -> int:
        """Global index of the first layer of (``stage``, ``chunk``)."""
        return self._offsets[stage, chunk]

    def where(self, layer: int) -> Tuple[int, int, int]:
        """(stage, chunk, local index) of global layer ``layer``."""
        return self._where[layer]

    def max_chunk_layers(self) -> int:
        return max(self._counts.values())

    def counts(self) -> str:
        """The layers of each stage, ``+``-joined per chunk ("1 3", "1+1 2+2"): equal strings, equal placements
        (the offsets follow from the counts)."""
        return " ".join("+".join(str(self._counts[s, c]) for c in range(self.vp)) for s in range(self.pp))

    def describe(self) -> str:
        return f"layers per pipeline stage {self.counts()} ({self.flags()})"

    def split_args(self) -> Dict[str, Any]:
        """The four split flags as pretrain_gpt's arguments (what a checkpoint's args record)."""
        return dict(zip(LAYOUT_ARGS, (self.first, self.last, self.account_for_embedding, self.account_for_loss)))


def layout_counts(args: Dict[str, Any], pp: int, vp: Optional[int] = None) -> str:
    """:meth:`PipelineLayout.counts` of a checkpoint's ``args`` (or the reason they give none): what a resume
    compares."""
    try:
        return PipelineLayout.from_args(args, pp, vp).counts()
    except ValueError as e:
        return str(e)
