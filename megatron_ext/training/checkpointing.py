"""Reshardable, atomic checkpoints for pretrain_gpt: model, ODO state, LR scheduler, RNG and data position.

[Note: layout]
``<dir>/iter_0000010/`` holds

* ``common.pt`` (global rank 0): iteration, consumed train/valid samples, LR scheduler state, parallel sizes, args;
* ``mp_rank_TT_PPP/model.pt`` (DP rank 0 of each TP/PP position): the unwrapped megatron-core module's state dict
  (with an interleaved pipeline, as Megatron-LM, one per model chunk: ``{"model0": ..., "model1": ...}``);
* ``mp_rank_TT_PPP/optim.pt``: the ODO state of that TP/PP position in *canonical* layout, i.e. per parameter name
  and unsharded (the DP shards are gathered and merged with ``merge_optimizer_shards``), so it loads at any DP
  size, bucket size or backend;
* ``rng/rank_NNNNN.pt`` (every rank): CPU/CUDA/NumPy/Python RNG and megatron-core's model-parallel RNG tracker;
* ``manifest.json`` (written last): every file with its size and CRC-32, computed while the file was written.

``<dir>/latest_checkpointed_iteration.txt`` (Megatron-LM's tracker name) names the newest complete checkpoint.

Cost: each DP rank writes its shard, and DP rank 0 of each TP/PP position merges them from disk (CPU memory there:
the full fp32 master + Adam moments of that position, 12 bytes per parameter; nothing goes over the network);
loading maps ``optim.pt`` (``mmap``), so each rank pages in only the slices it owns.

[Note: atomicity]
All ranks write into ``iter_XXXXXXX.tmp``; the ranks then report their files to rank 0 in one collective, so a rank
that died mid-save makes the collective fail on the others and nothing below happens. Rank 0 writes the manifest,
renames the directory into place and only then replaces the tracker file (write-to-temp + ``os.replace``). A crash
at any point leaves the previous checkpoint and tracker untouched.

Re-saving an iteration that already exists (a resumed run passing it again) cannot swap two directories in one
step, so it keeps this invariant instead: at every instant ``iter_N`` or ``iter_N.old`` holds a complete checkpoint
of iteration N. The old directory is renamed to ``.old`` (never deleted) before the new one is renamed into place,
and removed only afterwards; :func:`find_checkpoint` falls back to ``iter_N.old`` when ``iter_N`` is missing. The next
save cleans up after crashed ones: it removes every ``.tmp`` and every ``.old`` whose ``iter_N`` exists, and renames
an ``.old`` whose ``iter_N`` is missing back into place (it is the only copy of that checkpoint).

[Note: durability]
Every file is fsynced after it is written, and so is the directory it was created in; rank 0 fsyncs the checkpoint
directory after the manifest and the save directory after each rename. So once the tracker names an iteration,
that checkpoint survives a power loss on a POSIX local filesystem; on network filesystems it is as durable as their
fsync/close-to-open semantics make it.

[Note: loading]
Every rank reads its files and checks everything that could fail before anything is applied: the tracker, manifest
and file sizes; the CRC-32 of every file (the ranks share the files, each reading its own part once); the saved flags that fix the model's shape (Megatron-LM's ``check_checkpoint_args``:
:data:`MODEL_FLAGS`); every model tensor's name and shape; the optimizer type and every parameter's optimizer state;
and the LR schedule (Megatron-LM's ``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler``;
with neither, a schedule flag that differs from the checkpoint is an error). The ranks then agree in one all-reduce,
and if any rank failed every rank raises CheckpointError with the first failing rank's message, so no rank applies a
partial checkpoint or waits in a collective for a peer that gave up. TP/PP sizes must match the saving run
(``tools/reshard_checkpoint.py`` rewrites a checkpoint for others: checkpoint_reshard.py); the DP size may differ
(the RNG streams are then re-seeded instead of restored, since ranks do not map one to one).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import shutil
import zlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy
import torch
import torch.distributed as dist

from .checkpoint_compat import load_scheduler_state, scheduler_state

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT = "megatron_ext.pretrain_gpt/1"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the path and the reason. ``everywhere``: every rank
    raised it together, rank 0 with the whole story (``pretrain_gpt`` prints it there only)."""

    everywhere = False


class AgreedCheckpointError(CheckpointError):
    everywhere = True


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def mp_dir_name(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


# ---- RNG -------------------------------------------------------------------------------------------------------


def get_rng_state() -> Dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {"random": random.getstate(), "numpy": numpy.random.get_state(), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    try:
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    except Exception:  # tracker not initialised
        state["tracker"] = None
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("tracker") is not None:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


# ---- save -------------------------------------------------------------------------------------------------------


class _CrcWriter(io.RawIOBase):
    """A write-only file that keeps a running CRC-32 of the bytes going through it (no second read of the file)."""

    def __init__(self, f) -> None:
        super().__init__()
        self._f = f
        self.crc = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.crc = zlib.crc32(b, self.crc)
        return self._f.write(b)


def _fsync_save(obj: Any, path: str) -> int:
    """torch.save, then fsync the file and the directory that holds its name (see the durability note); returns
    the CRC-32 of the bytes written (the manifest records it, ``--load`` verifies it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        w = _CrcWriter(f)
        torch.save(obj, w)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(os.path.dirname(path))
    return w.crc


def file_crc32(path: str, chunk: int = 1 << 22) -> int:
    """CRC-32 of a file, read in chunks."""
    crc = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return crc
            crc = zlib.crc32(b, crc)


def _crash_hook(iteration: int) -> None:
    """Test hook: ``MEGATRON_EXT_TEST_CRASH_IN_SAVE=<global rank>:<iteration>`` kills that rank while it saves that
    iteration, after writing its own files and before the checkpoint is published (a simulated node failure)."""
    target = os.environ.get("MEGATRON_EXT_TEST_CRASH_IN_SAVE")
    if target:
        rank, it = (int(x) for x in target.split(":"))
        if rank == dist.get_rank() and it == iteration:
            os._exit(17)


def save_checkpoint(save_dir: str, iteration: int, model: Sequence, optimizer, scheduler, *,
                    consumed_train_samples: int, consumed_valid_samples: int, args_dict: Dict[str, Any],
                    save_optim: bool = True) -> str:
    """Collective over the world: write ``iter_<iteration>`` atomically and point the tracker at it. ``model``:
    this stage's model chunks (a list, as Megatron-LM's)."""
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    dp_rank, dp_group = ps.get_data_parallel_rank(), ps.get_data_parallel_group()
    final = os.path.join(save_dir, iter_dir_name(iteration))
    tmp = final + ".tmp"
    # Fresh weights everywhere: the ODO's last all-gather may still be in flight.
    optimizer.force_param_sync()
    error: Optional[str] = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            remove_stale(save_dir)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = f"--save {save_dir}: cannot create {tmp}: {e} (the previous checkpoint is untouched)"
    agree_on_error(error, "nothing was saved")   # every rank raises together, none waits for a failed rank 0

    written: Dict[str, int] = {}   # path -> CRC-32 of what was written

    def save(obj: Any, path: str) -> None:
        written[path] = _fsync_save(obj, path)

    mp_dir = os.path.join(tmp, mp_dir_name(tp_rank, pp_rank))
    if save_optim:
        # Each DP rank writes its own shard; DP rank 0 merges them from disk into the canonical per-parameter file.
        from megatron_ext.optimizer.checkpoint import write_canonical_optimizer_state

        optim_path = os.path.join(mp_dir, "optim.pt")

        def save_optim_file(obj: Any, path: str) -> None:   # the per-rank shards are merged and removed
            crc = _fsync_save(obj, path)
            if path == optim_path:
                written[path] = crc

        write_canonical_optimizer_state(optimizer.state_dict(), optim_path, dp_group, save=save_optim_file)
    if dp_rank == 0:
        save(model_state_dict(model), os.path.join(mp_dir, "model.pt"))
    save(get_rng_state(), os.path.join(tmp, "rng", f"rank_{rank:05d}.pt"))
    if rank == 0:
        common = {"format": FORMAT, "iteration": iteration, "consumed_train_samples": consumed_train_samples,
                  "consumed_valid_samples": consumed_valid_samples,
                  "scheduler": scheduler_state(scheduler) if scheduler is not None else None,
                  "world_size": dist.get_world_size(),
                  "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
                  "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
                  "data_parallel_size": ps.get_data_parallel_world_size(), "has_optim": save_optim,
                  "args": args_dict}
        save(common, os.path.join(tmp, "common.pt"))
    for chunk in model:
        chunk.drop_gathered_weights()   # ZeRO-3: the full weights gathered for model.pt go again
    _crash_hook(iteration)

    # One collective doubles as "every rank finished writing": a dead rank makes it fail, so nothing is published.
    files = {os.path.relpath(p, tmp): {"size": os.path.getsize(p), "crc32": crc} for p, crc in written.items()}
    everyone: Optional[List[Dict[str, dict]]] = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(files, everyone, dst=0)
    if rank == 0:
        write_manifest(tmp, iteration, {k: v for f in everyone for k, v in f.items()})
        publish_checkpoint(save_dir, iteration)
    dist.barrier()
    return final


def write_manifest(tmp: str, iteration: int, files: Dict[str, dict]) -> None:
    """``manifest.json`` of the checkpoint being written in ``tmp`` (``files``: relative path -> size and CRC-32),
    written last and fsynced with its directory, so it is the mark of a complete checkpoint."""
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump({"format": FORMAT, "iteration": iteration, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)


def publish_checkpoint(save_dir: str, iteration: int) -> str:
    """Rank 0: move the complete ``iter_N.tmp`` into place as ``iter_N`` and point the tracker at it.

    A re-save of an existing ``iter_N`` keeps ``iter_N`` or ``iter_N.old`` complete at every instant (see the
    atomicity note); the tracker is replaced last, with write-to-temp + ``os.replace``.
    """
    final = os.path.join(save_dir, iter_dir_name(iteration))
    tmp, old = final + ".tmp", final + ".old"
    if os.path.isdir(final):
        shutil.rmtree(old, ignore_errors=True)  # iter_N is complete, so a leftover .old is not needed
        os.rename(final, old)
        _fsync_dir(save_dir)
        os.rename(tmp, final)
        _fsync_dir(save_dir)
    else:
        os.rename(tmp, final)
        _fsync_dir(save_dir)
    shutil.rmtree(old, ignore_errors=True)  # the replaced version, or the fallback of an interrupted re-save
    tracker_tmp = os.path.join(save_dir, TRACKER + ".tmp")
    with open(tracker_tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker_tmp, os.path.join(save_dir, TRACKER))
    _fsync_dir(save_dir)
    return final


def check_offline_target(load_dir: str, save_dir: str, what: str) -> None:
    """The reshard and import tools write ``what`` into a new or empty ``save_dir`` outside ``load_dir``: the source
    stays untouched, and publishing never moves another run's tracker or replaces its checkpoint of that iteration."""
    src_dir, dst_dir = os.path.realpath(load_dir), os.path.realpath(save_dir)
    if os.path.commonpath([src_dir, dst_dir]) == src_dir:
        raise CheckpointError(f"--save {save_dir} is the --load directory or inside it: write the {what} checkpoint "
                              "elsewhere (the source stays untouched)")
    if os.path.isdir(save_dir) and (os.path.exists(os.path.join(save_dir, TRACKER))
                                    or published_checkpoints(save_dir)):
        raise CheckpointError(f"--save {save_dir} already holds checkpoints: give a new or empty directory (publishing "
                              "there would move its tracker and could replace a checkpoint of the same iteration)")


@contextlib.contextmanager
def offline_checkpoint(save_dir: str, iteration: int) -> Iterator[Callable[[Any, str], None]]:
    """One process (the reshard and import tools) writes checkpoint ``iteration`` into ``save_dir``: yields
    ``save(obj, relative_path)``; when the block completes, the manifest is written and the checkpoint published as
    a training run's save is (atomicity note); on any error the partial directory is removed, nothing published."""
    final = os.path.join(save_dir, iter_dir_name(iteration))
    tmp = final + ".tmp"
    os.makedirs(save_dir, exist_ok=True)
    remove_stale(save_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    written: Dict[str, int] = {}

    def save(obj: Any, rel: str) -> None:
        written[rel] = _fsync_save(obj, os.path.join(tmp, rel))

    try:
        yield save
        write_manifest(tmp, iteration, {rel: {"size": os.path.getsize(os.path.join(tmp, rel)), "crc32": crc}
                                        for rel, crc in written.items()})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_checkpoint(save_dir, iteration)


_LEFTOVER = re.compile(r"iter_(\d{7,})\.(tmp|old)")
_PUBLISHED = re.compile(r"iter_(\d{7,})")


def remove_stale(save_dir: str) -> None:
    """Rank 0, before a save: clean up after crashed saves (see the atomicity note).

    ``.tmp`` directories are never a complete, published checkpoint and are removed. An ``iter_N.old`` is removed
    when ``iter_N`` exists; otherwise it is the only (complete) copy of iteration N and is renamed back into place.
    """
    if not os.path.isdir(save_dir):
        return
    for name in sorted(os.listdir(save_dir)):
        m = _LEFTOVER.fullmatch(name)
        if m is None:
            continue
        path = os.path.join(save_dir, name)
        final = os.path.join(save_dir, iter_dir_name(int(m.group(1))))
        if m.group(2) == "old" and not os.path.isdir(final):
            os.rename(path, final)
        else:
            shutil.rmtree(path, ignore_errors=True)
    try:
        os.unlink(os.path.join(save_dir, TRACKER + ".tmp"))
    except FileNotFoundError:
        pass
    _fsync_dir(save_dir)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def model_state_dict(model: Sequence) -> Dict[str, Any]:
    """``model.pt``'s content, on the CPU: the unwrapped module's state dict, or one per chunk under Megatron-LM's
    keys ``model0``, ``model1``, ... when the stage holds several (interleaved pipeline)."""
    from megatron_ext.optimizer.checkpoint import to_cpu

    states = [to_cpu(_unwrap(chunk).state_dict()) for chunk in model]
    return states[0] if len(states) == 1 else {f"model{i}": st for i, st in enumerate(states)}


def chunk_states(saved: Dict[str, Any], chunks: int) -> List[Dict[str, Any]]:
    """:func:`model_state_dict`'s inverse for a stage of ``chunks`` model chunks; CheckpointError when the
    checkpoint holds another number of chunks (a checkpoint older than the flag that records it)."""
    keys = [f"model{i}" for i in range(chunks)]
    saved_chunks = sorted((k for k in saved if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    if chunks == 1 and not saved_chunks:
        return [saved]
    if saved_chunks == keys and len(saved) == chunks:
        return [saved[k] for k in keys]
    raise CheckpointError(f"the checkpoint holds {len(saved_chunks) or 1} model chunk(s) per pipeline stage, this "
                          f"run {chunks} (--num-virtual-stages-per-pipeline-rank / "
                          "--num-layers-per-virtual-pipeline-stage must match the saving run)")


# ---- load -------------------------------------------------------------------------------------------------------


def find_checkpoint(load_dir: str, iteration: Optional[int] = None) -> Optional[str]:
    """The complete checkpoint directory the tracker names (or of ``iteration``: ``--ckpt-step``), validated against
    its manifest; None if none saved.

    Raises CheckpointError for a missing ``load_dir`` or a damaged checkpoint.
    """
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: no such directory")
    if iteration is not None:
        return _find_tracked(load_dir, iteration, "--ckpt-step asks for")
    tracker = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(tracker):
        return _untracked_checkpoint(load_dir)
    with open(tracker) as f:
        text = f.read().strip()
    try:
        iteration = int(text)
    except ValueError:
        _refuse_megatron_lm_layout(load_dir, [os.path.join(load_dir, text)] if text == "release" else [])
        raise CheckpointError(f"--load {load_dir}: corrupt tracker file {tracker} (content {text[:40]!r} is not an "
                              "iteration number)") from None
    ckpt = _find_tracked(load_dir, iteration)   # (first: a missing one is an error, not a warning then an error)
    newer = [name for it, name in published_checkpoints(load_dir) if it > iteration]
    if newer and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"WARNING: --load {load_dir}: the tracker names iteration {iteration}, but newer complete checkpoints "
              f"exist ({', '.join(newer)}: a save whose tracker update failed, or a rollback); resuming from "
              f"iteration {iteration} as the tracker says (a later save of those iterations replaces them)",
              flush=True)
    return ckpt


def _find_tracked(load_dir: str, iteration: int, named_by: str = "the tracker names") -> str:
    """Checkpoint ``iteration`` of ``load_dir``, validated against its manifest."""
    ckpt = os.path.join(load_dir, iter_dir_name(iteration))
    if not os.path.isdir(ckpt) and os.path.isdir(ckpt + ".old"):
        ckpt += ".old"  # a re-save of this iteration was interrupted between its two renames (atomicity note)
    manifest_path = os.path.join(ckpt, "manifest.json")
    if not os.path.isdir(ckpt):
        there = ", ".join(name for _, name in published_checkpoints(load_dir))
        how = ("pass the iteration to resume from as --ckpt-step, or write it into " + TRACKER
               if named_by == "the tracker names" else "pass one of them as --ckpt-step")
        raise CheckpointError(f"--load {load_dir}: {named_by} iteration {iteration} but {ckpt} is missing"
                              + (f" (complete checkpoints there: {there}; {how})" if there else ""))
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        _refuse_megatron_lm_layout(load_dir, [ckpt])
        raise CheckpointError(f"--load {load_dir}: {manifest_path} is missing (incomplete checkpoint)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"--load {load_dir}: corrupt manifest {manifest_path} ({e.msg})") from None
    for rel, entry in manifest.get("files", {}).items():
        p = os.path.join(ckpt, rel)
        size = entry["size"] if isinstance(entry, dict) else entry   # checkpoints before checksums: sizes only
        if not os.path.isfile(p):
            raise CheckpointError(f"--load {load_dir}: corrupt checkpoint: {p} is missing")
        if os.path.getsize(p) != size:
            raise CheckpointError(f"--load {load_dir}: corrupt checkpoint: {p} has {os.path.getsize(p)} bytes, "
                                  f"the manifest says {size}")
    return ckpt


def _untracked_checkpoint(load_dir: str) -> Optional[str]:
    """No tracker: None when no checkpoint was ever published there. A published ``iter_N`` (renamed into place with
    its manifest) whose tracker write failed is found instead of training over it from scratch: the newest one is
    validated and used, with a warning on rank 0."""
    published = published_checkpoints(load_dir)
    if not published and os.path.isfile(os.path.join(load_dir, "manifest.json")):
        parent = os.path.dirname(os.path.abspath(load_dir))
        raise CheckpointError(f"--load {load_dir} is one checkpoint's directory; pass the directory that holds it and "
                              f"its {TRACKER} (--load {parent}, as for Megatron-LM)")
    if not published:
        # Megatron-LM's iteration directories, without its tracker
        _refuse_megatron_lm_layout(load_dir, [os.path.join(load_dir, n) for n in sorted(os.listdir(load_dir))
                                              if n.startswith("iter_")])
        return None
    iteration, name = published[-1]
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"WARNING: --load {load_dir}: no {TRACKER}, but {name} was published (a save that failed after its "
              f"rename); resuming from iteration {iteration}", flush=True)
    return _find_tracked(load_dir, iteration)


def published_checkpoints(load_dir: str) -> List[Tuple[int, str]]:
    """``(iteration, name)`` of every published checkpoint (``iter_N`` renamed into place with its manifest),
    oldest first."""
    return sorted((int(m.group(1)), name) for name in os.listdir(load_dir)
                  if (m := _PUBLISHED.fullmatch(name)) and os.path.isfile(os.path.join(load_dir, name,
                                                                                   "manifest.json")))


def megatron_lm_format(d: str) -> Optional[str]:
    """The ``--ckpt-format`` of Megatron-LM's iteration directory ``d`` (torch: ``mp_rank_*/model_optim_rng.pt``;
    torch_dist: PyTorch Distributed Checkpoint files, ``.metadata`` and ``*.distcp``), or None."""
    if not os.path.isdir(d):
        return None
    names = os.listdir(d)
    if any(n.startswith("mp_rank_") and os.path.isfile(os.path.join(d, n, "model_optim_rng.pt")) for n in names):
        return "torch"
    if ".metadata" in names or any(n.endswith(".distcp") for n in names):
        return "torch_dist"
    return None


def _refuse_megatron_lm_layout(load_dir: str, candidates: List[str]) -> None:
    """A Megatron-LM checkpoint (:func:`megatron_lm_format`, or a ``release`` tracker) is not a damaged one of
    ours: say what it is."""
    for d in [*candidates, load_dir]:
        fmt = megatron_lm_format(d)
        if fmt:
            raise CheckpointError(f"--load {load_dir}: {d} is a Megatron-LM checkpoint (--ckpt-format {fmt}); "
                                  "pretrain_gpt loads only its own checkpoints (manifest.json, common.pt): import it "
                                  "with tools/import_megatron_lm_checkpoint.py, or continue it with Megatron-LM and "
                                  "the megatron_ext plug-in")
    if any(os.path.basename(d) == "release" for d in candidates):
        raise CheckpointError(f"--load {load_dir}: the tracker says 'release', a Megatron-LM release checkpoint; "
                              "pretrain_gpt loads only its own checkpoints")


def verify_checksums(ckpt: str, rank: int = 0, world: int = 1) -> int:
    """Check the CRC-32 the manifest records for this rank's share of the files (file i goes to rank i % world, so
    the ranks read the checkpoint once between them); raises CheckpointError naming the first damaged file.
    Returns the bytes read. Checkpoints saved before checksums (sizes only) are not checked."""
    with open(os.path.join(ckpt, "manifest.json")) as f:
        files = sorted(json.load(f).get("files", {}).items())
    return sum(_verify_file(ckpt, rel, entry) for i, (rel, entry) in enumerate(files) if i % world == rank)


def _verify_file(ckpt: str, rel: str, entry: Any) -> int:
    """Check one file's CRC-32 against its manifest entry; returns the bytes read (0: no checksum recorded)."""
    if not isinstance(entry, dict) or "crc32" not in entry:
        return 0
    p = os.path.join(ckpt, rel)
    crc = file_crc32(p)
    if crc != entry["crc32"]:
        raise CheckpointError(f"corrupt checkpoint file {p}: its CRC-32 is {crc:08x}, the manifest recorded "
                              f"{entry['crc32']:08x} when it was written (the file changed after the save)")
    return os.path.getsize(p)


def _load(path: str, mmap: bool = False) -> Any:
    """torch.load with errors naming the file; ``mmap`` maps tensors from the file instead of reading them, so a
    rank that needs a slice of a large canonical optimizer state only pages in that slice."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as e:
        raise CheckpointError(f"corrupt checkpoint file {path}: {type(e).__name__}: {e}") from None


def load_checkpoint(ckpt: str, model: Sequence, optimizer, scheduler, *, args: Optional[argparse.Namespace] = None,
                    load_optim: bool = True, load_rng: bool = True) -> Dict[str, Any]:
    """Load ``ckpt`` (from :func:`find_checkpoint`) into model/ODO/scheduler; returns ``common.pt``'s dict.

    Collective over the world. Every rank reads its files and checks that they fit this run (see the loading
    note; ``args`` are this run's flags, compared with the saved ones) without touching the model; the ranks then
    agree that all of them succeeded before anything is applied, and otherwise all raise CheckpointError.
    """
    error: Optional[str] = None
    try:   # the checksums first, agreed by all ranks, so no rank unpickles a damaged file another rank has checked
        verify_checksums(ckpt, dist.get_rank(), dist.get_world_size())
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - an I/O error here must reach the agreement, not strand the peers
        error = f"{ckpt}: {type(e).__name__} while checking the checksums: {e}"
    agree_on_error(error)
    loaded = None
    try:
        loaded = _read_checkpoint(ckpt, load_optim, load_rng)
        problems = _check_fits(loaded, model, optimizer, scheduler, args, load_optim)
        if problems:
            error = f"{ckpt} does not fit this run: " + "; ".join(problems)
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - any failure here must reach the agreement, not strand the peers
        error = f"{ckpt}: {type(e).__name__}: {e}"
    agree_on_error(error)
    common, model_state, optim_state, rng_state = loaded
    from .checkpoint_compat import fit_extra_states

    for chunk, state in zip(model, chunk_states(model_state, len(model))):
        _unwrap(chunk).load_state_dict(fit_extra_states(state, _unwrap(chunk)), strict=True)
    if load_optim:
        # The optimizer's param groups carry max_lr/min_lr, which the scheduler reads before its own values and the
        # optimizer state brings back from the checkpoint; under --override-opt_param-scheduler this run's bounds
        # must win (Megatron-LM issue #1138), so they are put back before the scheduler recomputes the LR.
        bounds = [{k: g[k] for k in ("max_lr", "min_lr") if k in g} for g in optimizer.param_groups]
        optimizer.load_state_dict(optim_state)
        if scheduler is not None and getattr(scheduler, "override_opt_param_scheduler", False):
            for g, b in zip(optimizer.param_groups, bounds):
                g.update(b)
        if scheduler is not None and common.get("scheduler") is not None:
            load_scheduler_state(scheduler, common["scheduler"])
    else:
        optimizer.reload_model_params()
    if rng_state is not None:
        set_rng_state(rng_state)
    for chunk in model:
        chunk.start_param_sync(force_sync=True)   # gathers in flight done (ZeRO-3 gathers as the next forward goes)
    return common


def _check_fits(loaded, model, optimizer, scheduler, args: Optional[argparse.Namespace], load_optim: bool
                ) -> List[str]:
    from .checkpoint_compat import (check_checkpoint_args, check_model_state, check_optimizer_state,
                                    check_scheduler_state)

    common, model_state, optim_state, _ = loaded
    saved_args = common.get("args") or {}
    problems: List[str] = []
    if args is not None:
        problems += check_checkpoint_args(saved_args, args)
        if problems:  # the shapes below would only repeat these
            return problems + ["resume with the saving run's values of these flags"]
    for i, (chunk, state) in enumerate(zip(model, chunk_states(model_state, len(model)))):
        where = f"model chunk {i}" if len(model) > 1 else "model"
        problems += [f"{where}: {p}" for p in check_model_state(state, _unwrap(chunk))]
    if load_optim:
        problems += [f"optimizer: {p}" for p in check_optimizer_state(optim_state, optimizer)]
        if scheduler is not None and common.get("scheduler") is not None:
            sched = check_scheduler_state(common["scheduler"], scheduler, saved_args.get("global_batch_size"),
                                          getattr(args, "global_batch_size", None),
                                          samples=getattr(args, "train_samples", None) is not None)
            if sched:
                problems.append("the learning-rate schedule differs from the checkpoint's (" + "; ".join(sched) +
                                "): pass --override-opt_param-scheduler to use this run's flags, or "
                                "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule")
    return problems


def agree_on_error(error: Optional[str], consequence: str = "no rank loaded anything") -> None:
    """All ranks learn whether any rank failed; then every rank raises the first failing rank's message (the other
    ranks add ``consequence``)."""
    from .initialize import collective_device

    ok = torch.tensor([0.0 if error else 1.0], device=collective_device())
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() >= 1.0:
        return
    errors: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if error:
        raise AgreedCheckpointError(error)
    rank, first = next((r, e) for r, e in enumerate(errors) if e)
    raise AgreedCheckpointError(f"{first} (found by rank {rank}; {consequence})")


def agree_on_checkpoint(ckpt: Optional[str]) -> None:
    """Every rank must resume from the same checkpoint (or all start from scratch): a rank whose view of ``--load``
    differs (a node-local disk, a stale network-filesystem cache, a save racing the read) would otherwise skip the
    load, or load another iteration, while its peers wait in the load's collectives. Raises on every rank."""
    names: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(names, os.path.basename(ckpt) if ckpt else None)
    if len(set(names)) > 1:
        seen = {}
        for r, n in enumerate(names):
            seen.setdefault(n or "no checkpoint", []).append(r)
        raise AgreedCheckpointError("ranks see different checkpoints in --load ("
                                    + "; ".join(f"{n}: ranks {rs}" for n, rs in seen.items())
                                    + "): is the directory on a filesystem every node sees alike? No rank loaded "
                                    "anything")


def check_parallel_sizes(ckpt: str, chunks: Optional[int] = None, layout=None) -> Dict[str, Any]:
    """``common.pt`` of ``ckpt`` (its checksum checked before it is unpickled), if it was saved at this run's TP
    and PP sizes and, when given, ``chunks`` model chunks per stage and the same layers per stage as ``layout`` (a
    PipelineLayout), else CheckpointError."""
    from megatron.core import parallel_state as ps

    with open(os.path.join(ckpt, "manifest.json")) as f:
        _verify_file(ckpt, "common.pt", json.load(f).get("files", {}).get("common.pt"))
    common = _load(os.path.join(ckpt, "common.pt"))
    if not isinstance(common, dict) or common.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt}: not a megatron_ext pretrain_gpt checkpoint")
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    if (common["tensor_model_parallel_size"], common["pipeline_model_parallel_size"]) != (tp, pp):
        raise CheckpointError(
            f"{ckpt} was saved with --tensor-model-parallel-size {common['tensor_model_parallel_size']} "
            f"--pipeline-model-parallel-size {common['pipeline_model_parallel_size']}; this run uses {tp} and {pp} "
            "(only the data-parallel size may change on resume; tools/reshard_checkpoint.py rewrites a checkpoint "
            "for other TP/PP sizes)")
    saved_args = common.get("args") or {}
    saved_chunks = saved_args.get("virtual_pipeline_model_parallel_size") or 1
    if chunks is not None and "virtual_pipeline_model_parallel_size" in saved_args and saved_chunks != chunks:
        raise CheckpointError(
            f"{ckpt} does not fit this run: the model chunks per pipeline stage "
            f"(--num-virtual-stages-per-pipeline-rank or --num-layers-per-virtual-pipeline-stage): checkpoint "
            f"{saved_chunks}, this run {chunks} "
            "(tools/reshard_checkpoint.py --target-num-virtual-stages-per-pipeline-rank rewrites it)")
    if layout is not None and saved_args.get("num_layers") == layout.num_layers:
        from .pipeline_layout import layout_counts

        saved = layout_counts(saved_args, pp, layout.vp)
        if saved != layout.counts():
            raise CheckpointError(
                f"{ckpt} does not fit this run: the layers per pipeline stage: checkpoint {saved}, this run "
                f"{layout.counts()} ({layout.flags()}; tools/reshard_checkpoint.py "
                "--target-decoder-first/last-pipeline-num-layers or --target-even-pipeline-split rewrites it)")
    return common


def _read_checkpoint(ckpt: str, load_optim: bool, load_rng: bool):
    from megatron.core import parallel_state as ps

    common = check_parallel_sizes(ckpt)
    mp_dir = os.path.join(ckpt, mp_dir_name(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()))
    model_state = _load(os.path.join(mp_dir, "model.pt"), mmap=True)
    optim_state = None
    if load_optim:
        if not common.get("has_optim", True):
            how = ("was imported from Megatron-LM without its optimizer state" if common.get("imported_from")
                   else "was saved with --no-save-optim")
            raise CheckpointError(f"{ckpt} {how}; resume with --no-load-optim (or --finetune)")
        optim_state = _load(os.path.join(mp_dir, "optim.pt"), mmap=True)
    rng_state = None
    rng_path = os.path.join(ckpt, "rng", f"rank_{dist.get_rank():05d}.pt")
    if load_rng and common["world_size"] == dist.get_world_size() and os.path.isfile(rng_path):
        rng_state = _load(rng_path)
    return common, model_state, optim_state, rng_state
