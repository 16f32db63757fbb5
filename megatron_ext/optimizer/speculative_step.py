"""Speculative step: a bucket's update and weight gather start in backward, before the global clipping norm is known.

[Note: speculative step]
*Why.* With global gradient clipping a bucket's new weights exist only after the norm, which needs every gradient:
the weight gathers can then hide behind the next forward only. Where they carry most of a step's bytes (fp32 or
bf16 weights beside quantized gradients: qgZ, ByteGrad) a slow link idles through the backward and the step waits
for it in forward (docs/benchmarks: qgZ INT4 at 1.73x its link limit at 200 Mbit/s). Seed 000 and ZeRO++ leave
the step after the backward; megatron-core's ``--overlap-param-gather-with-optimizer-step`` overlaps the gather with
the step only.

*What.* ``OverlapConfig.speculative_step`` (``--odo-speculative-step``). A *round* opens at the first launch of the
step's final gradient reduction (the micro-batch outside ``no_sync()``: the same program point on every rank).
From then on, each time the backward delivers a gradient, the gradient path hands over every regular bucket whose
final reduction has finished (``GradSync._poll_speculation``), in bucket order: its pieces' masters and optimizer
state are copied (the snapshot), the inner optimizer steps those pieces alone with the unclipped gradient and the
new weights go into the ParameterBuffer shard; the bucket's all-gather follows as soon as the link has room (*Which
first*). The backward no longer reads that bucket's weights (all its gradients are in), and a read by attribute
waits for the gather as after any step (param_sync.py). At ``step()`` the norm decides:

* *commit* -- nothing is clipped (``clip_grad`` = 0 or the norm within it), the step is not skipped, the param
  groups' hyper-parameters are the ones noted when the round opened: the buckets beyond the round's agreed length
  (*Order*) are stepped (unless already) and gathered on the original group in forward order, then the round's
  own gathers are completed up to that length;
* *rollback* -- otherwise: the round's gathers are completed up to its agreed length with the current weights,
  waited for, the snapshots restored, and the usual step follows (clip, update every piece, gather every bucket
  on the original group).

A forward, ``zero_grad_buffer``, ``scale_gradients`` (by another factor than 1), the model's ``load_state_dict``,
an optimizer ``state_dict`` / ``load_state_dict`` or ``reload_model_params`` inside an open round rolls it back
first (and re-gathers the restored weights, which a load then overwrites). The model's own ``state_dict()`` inside
a round waits for the gathers but does not roll back (a save may run on one rank only, where an all-reduce would
hang): it reads the weights stepped so far, so save after ``step()``, as Megatron-LM does; speculation then rests until the step ends (a warning names the cause once). So the weights
after every step, and every tensor of the optimizer state, are those of the usual step bit for bit: the inner
optimizer is elementwise (Adam, AdamW, SGD, foreach), so stepping a bucket's pieces alone computes each element as
the whole step does, and a rollback restores the exact bytes it replaces.

*Order.* The speculative gathers go to a clone of the optim group of their own (``OverlappedDDP.speculative_gather``),
always in bucket order. *How many* a rank has issued when the round ends depends on timing, so the round's length is
agreed first: one MAX all-reduce on the original group (at step() or the abort, program points every rank
reaches), after which every rank has issued exactly that many on the speculative group, in bucket order, and the
buckets beyond it go to the original group, in forward order, on every rank. Every other collective keeps its
program point: the hand-over completes only reductions that are finished (an engine work's COMPLETE then issues
nothing).

*Which first.* The backward reduces the last layers first, the forward reads them last. A gather is issued while
fewer than ``GATHERS_IN_FLIGHT`` speculative gathers are unfinished, so the link is not queued deep with weights the
forward reads late when the step comes; the buckets not yet gathered then go in forward order (above), the first
layers' ahead. Measured (docs/benchmarks, 2 x 2 ranks, 200 Mbit/s, ``--clip-grad 0``): the gathers' bytes move
from the forward to the backward (qgZ INT4: 15.5 of 17.2 MB per node), the step falls by 15-25%; the link then idles
through most of the next forward. Holding some gathers for the forward (stepped in backward, gathered at step();
tried in stop 40 with the first third or a middle range of the bytes) moved up to 7 MB into the forward but
lengthened it by what the backward saved: no gain, reverted (docs/benchmarks, *Speculative step*).

*Cost.* The snapshot: each speculatively stepped bucket's masters and per-element optimizer state (Adam: 12 bytes
per parameter / optim group size), alive until the step. A rollback sends the weights twice. Worth it where steps
are mostly unclipped (``clip_grad`` 0, or a norm usually below it) and the link is slow; ``committed`` and
``rolled_back`` count the rounds.

*Limits.* ZeRO-1/2 on CPU (gloo), without fp16 loss scaling (its overflow check and unscaling are global like the
norm) or a per-token loss (finalize_model_grads scales every step's gradients after the backward), one model chunk
(chunks would share the gather group and the progress engine without agreeing on their interleaving), torch's inner
optimizers; checked at construction. No round opens while the forward pre-hooks are off (Megatron-LM's first
iteration): nothing would wait for the gathers lazily. On CUDA the update would have to run on the
communication stream (not built).
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch

from .bucketing import Bucket

logger = logging.getLogger(__name__)

# Speculative gathers on the link at once (see *Which first*): gloo runs two collectives of a group at a time, so two
# keep the link busy; more only queue ahead of the weights the next forward reads first.
GATHERS_IN_FLIGHT = 2


class SpeculativeStep:
    """One model chunk's speculative rounds (see the module note); driven by its GradSync and the optimizer."""

    def __init__(self, optimizer, chunk_index: int) -> None:
        self.opt = optimizer
        self.ci = chunk_index
        self.chunk = optimizer.chunks[chunk_index]
        self.gather = self.chunk.speculative_gather
        self.buckets: List[Bucket] = self.chunk.grad_sync.regular
        bucket_of = self.chunk.param_sync.bucket_of_param
        self.pieces: Dict[int, list] = {b.index: [] for b in self.chunk.buckets}
        for pc in optimizer.pieces:
            if pc.chunk == chunk_index:
                self.pieces[bucket_of[id(pc.param)]].append(pc)
        self.open = False        # a round: from the step's first final reduction to step() or an abort
        self.resting = False     # a round was aborted in this step: no speculation until the step ends
        self.stepped = 0         # of self.buckets, stepped in this round (bucket order)
        self.next = 0            # of those, gathered on the speculative group (bucket order)
        self.in_backward = 0     # buckets handed over before step() (for reports and tests)
        self._snapshots: Dict[int, Tuple[torch.Tensor, list]] = {}
        self._hyper: Optional[List[dict]] = None
        self._warned = False
        self.committed = 0
        self.rolled_back = 0
        gs, ps = self.chunk.grad_sync, self.chunk.param_sync
        gs.speculation = self
        ps.before_forward = lambda: self.abort("a forward ran between a backward and its step (gradient "
                                               "accumulation without no_sync(), or an evaluation)")
        ps.before_load = lambda: self.abort("the model's weights were loaded between a backward and its step")
        self.chunk.speculation = self

    # -- driven by GradSync ---------------------------------------------------------------------------------------
    def note_final_launch(self) -> None:
        """A final reduction was launched (the same program point on every rank): open the round. The param
        groups' hyper-parameters are noted here, not at the first hand-over (timing), so every rank compares the
        same values at step()."""
        if not self.open and not self.resting and self.chunk.param_sync.hooks_enabled:
            # (hooks off, as Megatron-LM's first iteration: every gather would be waited for at once in backward)
            self.open = True
            self.stepped = self.next = 0
            self._hyper = _hyper(self.opt.inner)

    def on_reduced(self, b: Bucket) -> None:
        """Bucket ``b`` (the next of ``self.buckets``) holds its step's reduced gradient: step it speculatively."""
        self._step(b, snapshot=True)
        self.in_backward += 1
        self.pump()

    def pump(self) -> None:
        """Gather stepped buckets while fewer than GATHERS_IN_FLIGHT are on the link (see *Which first*)."""
        ps = self.chunk.param_sync
        while self.next < self.stepped:
            busy = sum(ps.gathering(b.index) for b in self.buckets[max(0, self.next - GATHERS_IN_FLIGHT):self.next])
            if busy >= GATHERS_IN_FLIGHT:
                return
            self._gather(self.buckets[self.next])

    # -- driven by the optimizer ----------------------------------------------------------------------------------
    def hyper_unchanged(self) -> bool:
        return self._hyper == _hyper(self.opt.inner)

    def agreed_length(self) -> int:
        """The round's length on the speculative group: the most buckets any DP rank gathered there (one MAX
        all-reduce, at a program point every rank reaches: step() or an abort)."""
        return self.opt.all_ranks_max(self.next)

    def close(self, commit: bool, upto: int) -> None:
        """End the round at ``upto`` (:meth:`agreed_length`): commit (step and gather on this group up to there;
        the optimizer steps and gathers the rest, skipping what :attr:`stepped` covers) or roll back (gather up to
        there, wait, restore the snapshots). See the module note."""
        if not self.open:
            return
        if commit:
            while self.next < upto:
                b = self.buckets[self.next]
                if self.next >= self.stepped:
                    self._step(b, snapshot=False)
                self._gather(b)
            self.committed += 1
        else:
            ps = self.chunk.param_sync
            ps.launch_buckets(self.buckets[self.next:upto], self.gather)
            self.next = upto
            ps.wait_all()
            for idx, (master, states) in self._snapshots.items():
                self.opt.master_shards[self.ci][idx].copy_(master)
                for pc, saved in states:
                    _restore_state(self.opt.inner, pc.master, saved)
            self.stepped = 0
            self.rolled_back += 1
        self.open = False
        self._snapshots = {}
        self._hyper = None

    def abort(self, why: str) -> None:
        """Roll back an open round outside step() and gather the restored weights; rest until the step ends."""
        if not self.open:
            return
        self.close(commit=False, upto=self.agreed_length())
        self.opt.publish_chunk(self.ci)
        self.resting = True
        if not self._warned:
            self._warned = True
            logger.warning("speculative step (--odo-speculative-step) rolled back: %s; the weights are those of "
                           "the usual step, but this costs a second weight gather", why)

    def end_step(self) -> None:
        self.resting = False

    # -- internals ------------------------------------------------------------------------------------------------
    def _step(self, b: Bucket, snapshot: bool) -> None:
        """Step bucket ``b`` (the next unstepped one) and publish its new weights into the ParameterBuffer shard."""
        pcs = self.pieces[b.index]
        master = self.opt.master_shards[self.ci][b.index]
        self.chunk.param_sync.wait_bucket(b.index)   # a gather of the last step no forward read may still send it
        if snapshot:
            self._snapshots[b.index] = (master.clone(), [(pc, _copy_state(self.opt.inner, pc.master)) for pc in pcs])
        self.opt.step_pieces(pcs)
        self.opt.copy_masters(self.ci, [b])
        self.stepped += 1

    def _gather(self, b: Bucket) -> None:
        self.chunk.param_sync.launch_buckets([b], self.gather)
        self.next += 1


def _hyper(inner: torch.optim.Optimizer) -> List[dict]:
    return [{k: (v.item() if torch.is_tensor(v) and v.numel() == 1 else v) for k, v in g.items() if k != "params"}
            for g in inner.param_groups]


def _copy_state(inner: torch.optim.Optimizer, p: torch.Tensor) -> Optional[dict]:
    st = inner.state.get(p)
    if not st:
        return None
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}


def _restore_state(inner: torch.optim.Optimizer, p: torch.Tensor, saved: Optional[dict]) -> None:
    if saved is None:
        inner.state.pop(p, None)   # the first step created it: a fresh optimizer has none
        return
    st = inner.state[p]
    for k, v in saved.items():
        if torch.is_tensor(v) and torch.is_tensor(st.get(k)) and st[k].shape == v.shape:
            st[k].copy_(v)
        else:
            st[k] = v
