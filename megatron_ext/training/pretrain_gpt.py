"""``python -m megatron_ext.training.pretrain_gpt``: pretrain a megatron-core GPT with the ODO, Megatron-LM flags.

Launch with torchrun, e.g. (CPU, 4 gloo ranks, 2 simulated nodes)::

    torchrun --nproc-per-node 4 --standalone -m megatron_ext.training.pretrain_gpt \\
        --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 \\
        --micro-batch-size 4 --global-batch-size 32 --lr 1e-3 --train-iters 200 --ranks-per-node 2 ...

See examples/ for complete scripts. Without ``--data-path`` it trains on the cached standard-library corpus.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch.distributed as dist


def _build_data(args: argparse.Namespace):
    """Tokenizer and (train, valid, test) datasets; the default corpus is built once, on global rank 0."""
    from .corpus import build_default_corpus
    from .data import build_datasets, check_data_path, train_valid_test_num_samples
    from .tokenizer import load_tokenizer

    data_path = args.data_path
    tok_kwargs = dict(tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file, merge_file=args.merge_file,
                      vocab_size=args.vocab_size)
    tok_type = args.tokenizer_type
    per_split = ([args.train_data_path, args.valid_data_path, args.test_data_path] if args.train_data_path
                 else None)
    if not data_path and not per_split and not args.mock_data:
        if int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0:  # once per node (the cache is node-local)
            build_default_corpus()
        dist.barrier()
        prefix, tok_json = build_default_corpus()
        data_path, tok_type = [prefix], "HuggingFaceTokenizer"
        tok_kwargs["tokenizer_model"] = tok_json
        from .loop import print_rank_0
        print_rank_0(f"> no --data-path: training on the standard-library corpus at {prefix}")
        # the splits it leaves empty, named as for a --data-path (checked there while the flags were validated)
        args.data_notice = check_data_path(data_path, args.split, max(args.eval_iters, 0), what="the corpus")
    tokenizer = load_tokenizer(tok_type, **tok_kwargs)
    sizes = train_valid_test_num_samples(args.train_iters, args.global_batch_size, args.eval_interval,
                                         args.eval_iters, args.train_samples)
    datasets = build_datasets(data_path or [], args.split, args.seq_length, args.seed, tokenizer, sizes,
                              mock=args.mock_data, cache_dir=args.data_cache_path, eod_mask_loss=args.eod_mask_loss,
                              reset_position_ids=args.reset_position_ids, per_split=per_split)
    return tokenizer, datasets


def scheduler_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """megatron-core ``OptimizerParamScheduler`` arguments from the flags, as Megatron-LM builds them: steps are
    samples (the iteration flags times --global-batch-size, the sample flags as given; a warmup fraction is of the
    decay's samples, unrounded)."""
    if args.train_samples is not None:
        decay_steps, warmup, wsd_steps, wd_steps = (args.lr_decay_samples, args.lr_warmup_samples,
                                                    args.lr_wsd_decay_samples, args.train_samples)
    else:
        gbs = args.global_batch_size
        decay_steps, warmup, wd_steps = args.lr_decay_iters * gbs, args.lr_warmup_iters * gbs, args.train_iters * gbs
        wsd_steps = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
    warmup_steps = args.lr_warmup_fraction * decay_steps if args.lr_warmup_fraction is not None else warmup
    wsd = ({"wsd_decay_steps": wsd_steps, "lr_wsd_decay_style": args.lr_wsd_decay_style}
           if args.lr_decay_style == "WSD" else {})
    return dict(init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup_steps,
                lr_decay_steps=decay_steps, lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
                end_wd=args.end_weight_decay, wd_incr_steps=wd_steps,
                wd_incr_style=args.weight_decay_incr_style,
                use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
                override_opt_param_scheduler=args.override_opt_param_scheduler, **wsd)


def _build_optimizer(args: argparse.Namespace, model):
    import megatron_ext as mx
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    fp16_kw: Dict[str, Any] = {}
    if args.fp16:
        fp16_kw = dict(loss_scale=args.loss_scale,
                       initial_loss_scale=args.initial_loss_scale if args.initial_loss_scale is not None else 2**32,
                       min_loss_scale=args.min_loss_scale if args.min_loss_scale is not None else 1.0,
                       loss_scale_window=args.loss_scale_window if args.loss_scale_window is not None else 1000,
                       hysteresis=args.hysteresis if args.hysteresis is not None else 2)
    cfg = OptimizerConfig(optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                          decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
                          apply_wd_to_qk_layernorm=args.apply_wd_to_qk_layernorm,
                          adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                          sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
                          log_num_zeros_in_grad=args.log_num_zeros_in_grad,
                          params_dtype=args.params_dtype, use_distributed_optimizer=True, **fp16_kw)
    opt = mx.OverlappedDistributedOptimizer(cfg, model)
    sched = OptimizerParamScheduler(opt, **scheduler_kwargs(args))
    return opt, sched


def _overlap_config(args: argparse.Namespace):
    import megatron_ext as mx

    from .arguments import qgz_stages_config, sharding_plan_from_args

    plan = sharding_plan_from_args(args, args.data_parallel_size, args.dp_ranks_per_node)
    engine = getattr(args, "odo_progress_engine", None)
    extra = {} if engine is None else {"progress_engine": bool(engine)}
    extra.update(qgz_stages_config(args))
    return mx.OverlapConfig(bucket_size=args.ddp_bucket_size, sharding=plan, **extra,
                            overlap_grad_reduce=args.overlap_grad_reduce,
                            overlap_param_gather=args.overlap_param_gather, grad_reduce=args.grad_reduce,
                            param_gather=args.param_gather, ranks_per_node=args.dp_ranks_per_node,
                            check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
                            quant_group_size=args.quant_group_size, qgz_bits=args.qgz_bits,
                            speculative_step=args.odo_speculative_step)


def _backends_text(args: argparse.Namespace) -> str:
    """The backends with what shapes their bytes and error (bits, group size, qgZ's pipeline stages)."""
    grads = args.grad_reduce
    if grads == "qgz":
        stages = getattr(args, "qgz_pipeline_stages", None)
        grads += (f" INT{args.qgz_bits} (group {args.quant_group_size}"
                  + (f", {stages} pipeline stages" if stages is not None else "") + ")")
    params = args.param_gather + (f" INT8 (group {args.quant_group_size})" if args.param_gather == "qwz" else "")
    return f"gradients {grads}, parameters {params}"


def _print_args(args: argparse.Namespace) -> None:
    from .loop import print_rank_0

    lines = ["------------------------ arguments ------------------------"]
    for k in sorted(k for k in vars(args) if not k.endswith("_notice")):   # (notices: a line each, below)
        lines.append(f"  {k} {'.' * max(1, 40 - len(k))} {getattr(args, k)}")
    lines.append("-------------------- end of arguments ---------------------")
    print_rank_0("\n".join(lines))


def pretrain(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Parse flags, set up TP x PP x DP, train, evaluate and checkpoint. Returns the loss history (see loop.train).

    Works inside an existing process group (tests) or creates one from torchrun's environment.
    """
    from . import checkpointing
    from ..optimizer.group_collectives import set_ranks_per_node
    from .arguments import ignored_flag_notice, parse_args
    from .data import MicroBatchIterator
    from .initialize import init_distributed, init_model_parallel, teardown
    from .loop import ExitSignal, open_tensorboard, print_rank_0, train
    from .model import build_model_chunks, padded_vocab_size

    start_time = time.time()   # --exit-duration-in-mins counts from here, as Megatron-LM's from its start
    args = parse_args(argv)
    created = init_distributed(args.distributed_backend, args.distributed_timeout_minutes)
    stack = contextlib.ExitStack()
    try:
        from megatron.core import parallel_state as ps

        # SIGTERM from here on stops the run after its next iteration (set-up included, as Megatron-LM)
        exit_signal = stack.enter_context(ExitSignal()) if args.exit_signal_handler else None
        tb = stack.enter_context(contextlib.closing(open_tensorboard(args)))

        import megatron_ext as mx

        init_model_parallel(args)
        if getattr(args, "auto_plan_summary", None):   # --auto-plan: chosen while the flags were validated
            from .auto_plan import check_ranks_agree
            check_ranks_agree(args)
            print_rank_0(args.auto_plan_summary)
        # Which checkpoint to resume from, agreed by every rank before the data and the model are built (a wrong
        # --load fails in seconds, not after building the datasets' indices); it is read and checked further below.
        _notice_foreign_checkpoints(args)
        ckpt = _agreed_checkpoint(args) if args.load else None
        tokenizer, (train_ds, valid_ds, test_ds) = _build_data(args)
        # --vocab-size stays what the user gave (NullTokenizer's ids before EOD, as in Megatron-LM).
        args.tokenizer_vocab_size = tokenizer.vocab_size
        args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                                   args.tensor_model_parallel_size)
        _print_args(args)
        for notice in (ignored_flag_notice(args), getattr(args, "topology_notice", None),
                       getattr(args, "wiring_notice", None), getattr(args, "data_notice", None),
                       getattr(args, "quant_notice", None), getattr(args, "ladder_notice", None)):
            if notice:
                print_rank_0(notice)
        modules = build_model_chunks(args)
        set_ranks_per_node(args.ranks_per_node)   # the log's intra/inter split of TP/PP reductions too
        # As Megatron-LM: a list of this stage's model chunks (one per virtual stage), each wrapped on its own
        model = [mx.OverlappedDDP(m, _overlap_config(args), dp_group=ps.get_data_parallel_group()) for m in modules]
        optimizer, scheduler = _build_optimizer(args, model)
        n_params = sum(p.numel() for m in modules for p in m.parameters())
        chunks = f" in {len(modules)} chunks" if len(modules) > 1 else ""
        print_rank_0(f"> GPT stage 0: {n_params / 1e6:.2f}M parameters{chunks} on rank 0 (TP="
                     f"{args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} DP="
                     f"{args.data_parallel_size}), vocab {args.tokenizer_vocab_size} padded to "
                     f"{args.padded_vocab_size}, {args.num_micro_batches} micro-batches per step"
                     + (f" (ramped up from global batch {args.rampup_batch_size[0]} over "
                        f"{args.rampup_batch_size[2]} samples)" if args.rampup_batch_size else ""))
        print_rank_0(f"> sharding plan: {model[0].plan.describe()}; {_backends_text(args)}")

        iteration, consumed_train, consumed_valid = 0, 0, 0
        if ckpt is not None:
            if args.finetune:   # the weights only; everything else starts afresh
                common = checkpointing.load_checkpoint(ckpt, model, optimizer, scheduler, args=args,
                                                       load_optim=False, load_rng=False)
                print_rank_0(f"> --finetune: loaded the weights of {ckpt} (iteration {common['iteration']}); "
                             "starting at iteration 0 with a fresh optimizer, schedule and data position")
            else:
                common = checkpointing.load_checkpoint(ckpt, model, optimizer, scheduler, args=args,
                                                       load_optim=not args.no_load_optim,
                                                       load_rng=not args.no_load_rng)
                iteration = common["iteration"]
                consumed_train = common["consumed_train_samples"]
                consumed_valid = common["consumed_valid_samples"]
                saved_at = (f"saved at DP={common['data_parallel_size']}" if common.get("data_parallel_size")
                            else "imported from Megatron-LM" if common.get("imported_from")
                            else "resharded by tools/reshard_checkpoint.py")
                print_rank_0(f"> loaded checkpoint {ckpt} at iteration {iteration} ({saved_at}, now "
                             f"DP={args.data_parallel_size})")
                if iteration >= args.train_iters:
                    length = (f"--train-iters {args.train_iters}" if args.train_samples is None else
                              f"{args.train_iters} iterations (--train-samples {args.train_samples})")
                    print_rank_0(f"> the checkpoint is at iteration {iteration}, not below {length}: no iteration to "
                                 f"train (raise --train-{'iters' if args.train_samples is None else 'samples'} to "
                                 "continue)")

        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

        def batches(ds, consumed: int):
            """The split's micro-batches (None without data); with several chunks, as Megatron-LM, one iterator
            per chunk over the same order: each chunk reads one micro-batch per forward."""
            if ds is None or len(ds) == 0:
                return None
            its = [MicroBatchIterator(ds, consumed, args.micro_batch_size, dp_rank, dp_size) for _ in model]
            return its[0] if len(its) == 1 else its

        train_iter = batches(train_ds, consumed_train)
        valid_iter, test_iter = batches(valid_ds, consumed_valid), batches(test_ds, 0)

        if args.skip_train:   # as Megatron-LM: evaluate what was loaded (or the initial weights) and stop
            print_rank_0(f"> --skip-train: no training; evaluating the weights at iteration {iteration}")
            return {"iteration": iteration, "losses": {}, "eval": {}, "skipped": 0, "log": {},
                    "consumed_train_samples": consumed_train, "consumed_valid_samples": consumed_valid,
                    "exited": False,
                    "final_eval": _final_evaluation(args, model, optimizer, iteration, valid_iter, test_iter, tb)}
        args_dict = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None)))}

        def save(it: int, ct: int, cv: int) -> None:
            path = checkpointing.save_checkpoint(args.save, it, model, optimizer, scheduler,
                                                 consumed_train_samples=ct, consumed_valid_samples=cv,
                                                 args_dict=args_dict, save_optim=not args.no_save_optim)
            print_rank_0(f"> saved checkpoint {path}")

        result = train(args, model, optimizer, scheduler, train_iter, valid_iter, start_iteration=iteration,
                       consumed_train_samples=consumed_train, consumed_valid_samples=consumed_valid,
                       save_fn=save if args.save else None, start_time=start_time, exit_signal=exit_signal, tb=tb)
        if result["exited"]:   # saved before leaving; no final evaluation, as Megatron-LM
            return result
        if args.save and result["iteration"] > iteration and not (
                args.save_interval and result["iteration"] % args.save_interval == 0):
            save(result["iteration"], result["consumed_train_samples"], result["consumed_valid_samples"])
        result["final_eval"] = _final_evaluation(args, model, optimizer, result["iteration"], valid_iter, test_iter,
                                                 tb)
        return result
    finally:
        stack.close()
        teardown(created)


def _final_evaluation(args: argparse.Namespace, model, optimizer, iteration: int, valid_iter, test_iter, tb
                      ) -> Dict[str, float]:
    """After training, as Megatron-LM's ``pretrain``: one evaluation of ``--eval-iters`` batches on the validation
    set and one on the test set (each where the split has one)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from .loop import evaluate_and_print

    out: Dict[str, float] = {}
    if args.eval_iters <= 0:
        return out
    fb = get_forward_backward_func()
    for name, it in (("validation", valid_iter), ("test", test_iter)):
        if it is None:
            continue
        loss = evaluate_and_print(args, fb, model, optimizer, it, iteration, f"iteration {iteration} on {name} set",
                                  tb, f"lm loss {name}")
        if loss is not None:
            out[name] = loss
    return out


def _notice_foreign_checkpoints(args: argparse.Namespace) -> None:
    """A ``--save`` directory that already holds checkpoints this run does not load: its saves will sit among
    another run's, and one at the same iteration replaces that run's (Megatron-LM says nothing; found by user
    test 6)."""
    from . import checkpointing
    from .arguments import load_is_save
    from .loop import print_rank_0

    if not args.save or load_is_save(args):
        return
    tracker = os.path.join(args.save, checkpointing.TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            latest = f.read().strip()
        print_rank_0(f"> notice: --save {args.save} already holds checkpoints (latest: {latest}) that this run does "
                     "not load; its saves go among them, and a save at an iteration they have replaces theirs "
                     "(--load the same directory to resume them instead)")


def _agreed_checkpoint(args: argparse.Namespace) -> Optional[str]:
    """Collective: ``--load``'s checkpoint as every rank sees it (or None), after each rank found it complete and
    saved at this run's TP/PP sizes and pipeline layout; any rank's failure is raised on every rank."""
    from . import checkpointing
    from .arguments import pipeline_layout

    ckpt, error = None, None
    try:
        ckpt = _find_checkpoint_or_fail(args)
        if ckpt is not None:
            checkpointing.check_parallel_sizes(ckpt, args.virtual_pipeline_model_parallel_size or 1,
                                               pipeline_layout(args, args.pipeline_model_parallel_size))
    except checkpointing.CheckpointError as e:
        error = str(e)
    except OSError as e:   # an unreadable directory or file is an error too
        error = (f"--load {args.load}: {type(e).__name__} while looking for the checkpoint and checking its "
                 f"common.pt checksum: {e}")
    checkpointing.agree_on_error(error)  # a rank that cannot see the checkpoint stops all of them
    checkpointing.agree_on_checkpoint(ckpt)  # and all of them resume from the same one
    return ckpt


def _find_checkpoint_or_fail(args: argparse.Namespace):
    """The checkpoint to resume from, or None when ``--load`` is also ``--save`` and nothing was saved yet."""
    from . import checkpointing
    from .arguments import load_is_save
    from .loop import print_rank_0

    if args.ckpt_step is not None:   # an iteration asked for by name: missing is an error, also when --load = --save
        ckpt = checkpointing.find_checkpoint(args.load, args.ckpt_step)
        newer = [name for it, name in checkpointing.published_checkpoints(args.load) if it > args.ckpt_step]
        if newer and load_is_save(args):
            print_rank_0(f"> notice: --ckpt-step {args.ckpt_step} resumes before {', '.join(newer)} in --load = "
                         "--save: this run's saves move the tracker back and replace those of the same iteration "
                         "(drop --ckpt-step from a restart script once it has run)")
        return ckpt
    same_as_save = load_is_save(args) and not args.exit_on_missing_checkpoint   # else a missing one is an error
    if same_as_save and not os.path.isdir(args.load):
        print_rank_0(f"> --load {args.load}: no checkpoint yet (same directory as --save); starting from scratch")
        return None
    ckpt = checkpointing.find_checkpoint(args.load)
    if ckpt is None:
        if same_as_save:
            print_rank_0(f"> --load {args.load}: no checkpoint yet (same directory as --save); starting from scratch")
            return None
        raise checkpointing.CheckpointError(
            f"--load {args.load}: no checkpoint there (no {checkpointing.TRACKER}; a save that did not finish "
            "leaves none)")
    return ckpt


def main(argv: Optional[List[str]] = None) -> int:
    from .notices import quiet_known_notices

    quiet_known_notices()   # before megatron-core is imported: its import-time notices once, on rank 0
    from ..optimizer.distributed_optimizer import StepAbortedOnAllRanks
    from .checkpointing import CheckpointError

    try:
        pretrain(argv)
    except CheckpointError as e:
        # an error every rank agreed on, once (rank 0's names the rank that found it); one found by some ranks only,
        # by each of them
        _print_error(e, once=e.everywhere)
        return 2
    except StepAbortedOnAllRanks as e:   # every rank raised it together (a non-finite grad norm, a failed grad sync)
        _print_error(e, once=True)
        return 1
    return 0


def _print_error(e: Exception, once: bool) -> None:
    """One write, so that lines of several ranks do not run together; ``once``: from rank 0 only."""
    if not once or os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"pretrain_gpt: error: {e}\n")
        sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
