#!/usr/bin/env bash
# The Megatron-LM plug-in on a real checkout and real GPUs: tools/megatron_lm_check.sh CHECKOUT [OUT]
#
# Runs the checkout's own pretrain_gpt.py (mock data, NullTokenizer, a small GPT, bf16, --overlap-grad-reduce
# --overlap-param-gather, --ckpt-format torch, and torch_dist for (e), (f) and (h)-(k)) on every GPU of this machine and
# prints one verdict line per check.
# The local transformer without Apex or Transformer Engine needs --no-persist-layer-norm (torch's LayerNorm asserts
# it) and --no-masked-softmax-fusion (the fused softmax imports Apex's scaled_masked_softmax_cuda): both are set, so
# the check runs with or without them.
#   (a) Megatron-LM's own distributed optimizer against the ODO (launch module), and the ODO through the two-line
#       form (install() + add_args in a copy of pretrain_gpt.py): loss curves within two bf16 ulps (2^-7, see
#       tools/megatron_lm_verdict.py for why);
#   (b) the ODO saves at iteration HALF through Megatron-LM's checkpointing (save_parameter_state), resumes, and
#       logs the same losses as the uninterrupted run (exact);
#   (c) a resume of that checkpoint at another --ddp-bucket-size: within the bf16 tolerance of the uninterrupted run;
#   (d) that checkpoint imported (tools/import_megatron_lm_checkpoint.py: weights, data position, the ODO's optimizer
#       state) and continued by this package's pretrain_gpt with the same flags: within the bf16 tolerance of the
#       uninterrupted Megatron-LM run;
#   (e) Megatron-LM's own distributed optimizer saving in its default --ckpt-format torch_dist at iteration HALF,
#       that checkpoint imported (weights, data position, the DistributedOptimizer's state in its default
#       dp_reshardable layout, in buckets of 1M elements) and continued by pretrain_gpt: within the bf16 tolerance
#       of the uninterrupted run of (a);
#   (f) Megatron-LM's default, non-distributed optimizer (no --use-distributed-optimizer), run uninterrupted and
#       saving torch_dist at iteration HALF; that checkpoint imported (its Adam state, model space) and continued by
#       pretrain_gpt: within the bf16 tolerance of its uninterrupted run;
#   (g) Megatron-LM's own distributed optimizer saving (--ckpt-format torch) at iteration HALF and the ODO (launch
#       module) resuming from that checkpoint, its Adam state included: within the bf16 tolerance of (a)'s
#       uninterrupted run of Megatron-LM's optimizer;
#   (h) the ODO saving in Megatron-LM's default --ckpt-format torch_dist (its state in model space) at iteration
#       HALF and resuming: the same losses as the uninterrupted run (exact);
#   (i) the ODO resuming (f)'s torch_dist checkpoint of Megatron-LM's default optimizer, its Adam state included:
#       within the bf16 tolerance of (f)'s uninterrupted run;
#   (j) the way back: Megatron-LM's own distributed optimizer (the plug-in's flag dropped) resuming (h)'s torch_dist
#       checkpoint of the ODO, its Adam state included: within the bf16 tolerance of the ODO's uninterrupted run.
#       Needs Apex or Transformer Engine: megatron-core 0.16.1 cannot load a fully_reshardable state into torch's
#       Adam (KeyError 'step'), its own checkpoints included;
#   (k) the ODO resuming (e)'s torch_dist checkpoint of Megatron-LM's distributed optimizer in its default
#       dp_reshardable (bucket) layout, its Adam state included: within the bf16 tolerance of (a)'s uninterrupted run
#       of Megatron-LM's optimizer.
# Logs and checkpoints go to OUT (default ./megatron_lm_check). The checkout needs: pip install six regex pydantic
# (besides megatron-core, torch with CUDA and this package). Exit status: 0 when every check passed.
# MX_CHECK_DRY_RUN=1 needs no GPU: it prints each run's command ("RUN NAME ARGS...", shell-quoted) instead of running
# it; tests/unit_tests/megatron_lm check those commands on CPU (against the checkout where MEGATRON_LM_PATH names one).
set -uo pipefail

checkout=${1:-}
out=${2:-./megatron_lm_check}
if [ -z "$checkout" ] || [ ! -f "$checkout/pretrain_gpt.py" ]; then
  echo "usage: $0 MEGATRON_LM_CHECKOUT [OUT]  (no pretrain_gpt.py in '${checkout}')" >&2
  exit 2
fi
checkout=$(cd "$checkout" && pwd)
dry=${MX_CHECK_DRY_RUN:-0}
if [ "$dry" = 1 ]; then
  ngpu=1
else
  ngpu=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null)
fi
if [ -z "$ngpu" ] || [ "$ngpu" -lt 1 ]; then
  echo "$0: no CUDA GPU visible to torch: Megatron-LM's initialize_megatron requires CUDA" >&2
  exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
iters=${MX_CHECK_ITERS:-40}
half=$((iters / 2))
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH="$checkout${PYTHONPATH:+:$PYTHONPATH}"

common=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256
        --micro-batch-size 2 --global-batch-size $((4 * ngpu)) --train-iters "$iters" --log-interval 1
        --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 4 --weight-decay 0.01 --clip-grad 1.0
        --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 1023 --seed 1234
        --hidden-dropout 0.0 --attention-dropout 0.0 --no-gradient-accumulation-fusion
        --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ckpt-format torch
        --transformer-impl local --no-persist-layer-norm --no-masked-softmax-fusion
        --eval-iters 0 --eval-interval 100000)
launch=(python -m torch.distributed.run --standalone --nproc-per-node "$ngpu")

run() {  # run NAME ARGS... : one training run, log in $out/NAME.log (dry run: print "RUN NAME ARGS...", shell-quoted)
  local name=$1; shift
  if [ "$dry" = 1 ]; then
    printf 'RUN %s' "$name"; printf ' %q' "$@"; printf '\n'
    return
  fi
  echo "== $name" >&2
  "$@" > "$out/$name.log" 2>&1 || echo "   ($name exited with status $?, see $out/$name.log)" >&2
}

# The two-line form: a copy of the checkout's script with install() and add_args.
sed -e '0,/^from megatron.training import/s//import megatron_ext.megatron_lm as mxlm; mxlm.install()\nfrom megatron.training import/' \
    -e 's/extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None/extra_args_provider=mxlm.chain(add_modelopt_args if has_nvidia_modelopt else None)/' \
    "$checkout/pretrain_gpt.py" > "$out/pretrain_gpt_two_lines.py"
grep -q "mxlm.install()" "$out/pretrain_gpt_two_lines.py" || echo "   (the two-line edit did not apply: check $out/pretrain_gpt_two_lines.py)" >&2

odo=(--use-overlapped-distributed-optimizer)
rm -rf "$out/ckpt" "$out/ckpt_bucket" "$out/ckpt_imported" "$out/ckpt_dist" "$out/ckpt_dist_imported" \
    "$out/ckpt_default" "$out/ckpt_default_imported" "$out/ckpt_megatron" "$out/ckpt_odo_dist"
run megatron_dist_opt "${launch[@]}" -m megatron_ext.megatron_lm.launch "$checkout/pretrain_gpt.py" "${common[@]}"
run odo_launch "${launch[@]}" -m megatron_ext.megatron_lm.launch "$checkout/pretrain_gpt.py" "${common[@]}" "${odo[@]}"
run odo_two_lines "${launch[@]}" "$out/pretrain_gpt_two_lines.py" "${common[@]}" "${odo[@]}"
run odo_save "${launch[@]}" -m megatron_ext.megatron_lm.launch "$checkout/pretrain_gpt.py" "${common[@]}" "${odo[@]}" \
    --save "$out/ckpt" --save-interval "$half" --exit-interval "$half"
[ "$dry" = 1 ] || cp -r "$out/ckpt" "$out/ckpt_bucket"
run odo_resume "${launch[@]}" -m megatron_ext.megatron_lm.launch "$checkout/pretrain_gpt.py" "${common[@]}" "${odo[@]}" \
    --load "$out/ckpt" --save "$out/ckpt" --save-interval "$iters"
run odo_resume_bucket "${launch[@]}" -m megatron_ext.megatron_lm.launch "$checkout/pretrain_gpt.py" "${common[@]}" \
    "${odo[@]}" --load "$out/ckpt_bucket" --ddp-bucket-size 100000
# (g): a Megatron-LM run switches to the ODO at a checkpoint its own optimizer saved
run megatron_dist_opt_save "${launch[@]}" -m megatron_ext.megatron_lm.launch "$checkout/pretrain_gpt.py" "${common[@]}" \
    --save "$out/ckpt_megatron" --save-interval "$half" --exit-interval "$half"
run odo_resume_from_megatron "${launch[@]}" -m megatron_ext.megatron_lm.launch "$checkout/pretrain_gpt.py" \
    "${common[@]}" "${odo[@]}" --load "$out/ckpt_megatron"
# (d): pretrain_gpt takes Megatron-LM's flags but not --ckpt-format (its checkpoints have one layout)
ours=()
skip=0
for a in "${common[@]}"; do
  if [ "$skip" = 1 ]; then skip=0; continue; fi
  if [ "$a" = --ckpt-format ]; then skip=1; continue; fi
  ours+=("$a")
done
run import_ckpt python "$here/import_megatron_lm_checkpoint.py" --load "$out/ckpt_bucket" --save "$out/ckpt_imported" \
    --transformer-impl local
run pretrain_gpt_imported "${launch[@]}" -m megatron_ext.training.pretrain_gpt "${ours[@]}" --load "$out/ckpt_imported"
# (e), (f): a Megatron-LM run with its own optimizer saves its default --ckpt-format torch_dist at $half; imported
# (weights, data position, optimizer state) and continued by pretrain_gpt with (d)'s flags
save_import_continue() {  # save_import_continue CHECK CKPT MEGATRON_LM_FLAGS...
  local check=$1 ckpt=$2; shift 2
  run "megatron_${check}_save" "${launch[@]}" -m megatron_ext.megatron_lm.launch "$checkout/pretrain_gpt.py" "$@" \
      --ckpt-format torch_dist --save "$ckpt" --save-interval "$half" --exit-interval "$half"
  run "import_${check}" python "$here/import_megatron_lm_checkpoint.py" --load "$ckpt" --save "${ckpt}_imported"
  run "pretrain_gpt_imported_${check}" "${launch[@]}" -m megatron_ext.training.pretrain_gpt "${ours[@]}" \
      --load "${ckpt}_imported"
}
# (e): the distributed optimizer, in its default dp_reshardable layout, in buckets of 1M elements (several: the
# layout (k) and the import place parameters in)
save_import_continue torch_dist "$out/ckpt_dist" "${ours[@]}" --ddp-bucket-size 1000000
# (k): a run of Megatron-LM's distributed optimizer switches to the ODO at that checkpoint (its bucket layout)
run odo_resume_from_megatron_dist "${launch[@]}" -m megatron_ext.megatron_lm.launch "$checkout/pretrain_gpt.py" \
    "${common[@]}" "${odo[@]}" --ckpt-format torch_dist --load "$out/ckpt_dist"
# (f): Megatron-LM's default optimizer (not distributed; --overlap-param-gather needs the distributed one), also run
# uninterrupted
plain=()
for a in "${ours[@]}"; do
  case "$a" in --use-distributed-optimizer|--overlap-param-gather) ;; *) plain+=("$a") ;; esac
done
run megatron_default_opt "${launch[@]}" -m megatron_ext.megatron_lm.launch "$checkout/pretrain_gpt.py" "${plain[@]}" \
    --ckpt-format torch_dist
save_import_continue default_opt "$out/ckpt_default" "${plain[@]}"
# (h): the ODO saves torch_dist, Megatron-LM's default format, and resumes
run odo_dist_save "${launch[@]}" -m megatron_ext.megatron_lm.launch "$checkout/pretrain_gpt.py" "${common[@]}" \
    "${odo[@]}" --ckpt-format torch_dist --save "$out/ckpt_odo_dist" --save-interval "$half" --exit-interval "$half"
# (j): the way back: Megatron-LM's own distributed optimizer resumes that checkpoint (before (h)'s resume saves into it)
run megatron_resume_from_odo_dist "${launch[@]}" -m megatron_ext.megatron_lm.launch "$checkout/pretrain_gpt.py" \
    "${common[@]}" --ckpt-format torch_dist --load "$out/ckpt_odo_dist"
run odo_dist_resume "${launch[@]}" -m megatron_ext.megatron_lm.launch "$checkout/pretrain_gpt.py" "${common[@]}" \
    "${odo[@]}" --ckpt-format torch_dist --load "$out/ckpt_odo_dist" --save "$out/ckpt_odo_dist" --save-interval "$iters"
# (i): a run of Megatron-LM's default optimizer switches to the ODO at its torch_dist checkpoint
run odo_resume_from_megatron_default "${launch[@]}" -m megatron_ext.megatron_lm.launch "$checkout/pretrain_gpt.py" \
    "${common[@]}" "${odo[@]}" --ckpt-format torch_dist --load "$out/ckpt_default"

[ "$dry" = 1 ] && exit 0
status=0
verdict() { python "$here/megatron_lm_verdict.py" "$@" | tee -a "$out/verdicts.txt" || status=1; }
: > "$out/verdicts.txt"
verdict "(a) ODO (launch module) vs Megatron-LM distributed optimizer" "$out/megatron_dist_opt.log" "$out/odo_launch.log"
verdict "(a) ODO (two-line form) vs Megatron-LM distributed optimizer" "$out/megatron_dist_opt.log" "$out/odo_two_lines.log"
# (b), (c): Megatron-LM's line at half + 2 after a resume averages half + 1 and half + 2 (megatron_lm_verdict.py)
verdict "(b) ODO save at $half and resume vs uninterrupted" "$out/odo_launch.log" "$out/odo_resume.log" --rtol 0 \
    --first $((half + 1)) --skip $((half + 2))
verdict "(c) ODO resume at another bucket size vs uninterrupted" "$out/odo_launch.log" "$out/odo_resume_bucket.log" \
    --first $((half + 1)) --skip $((half + 2))
verdict "(g) the ODO resumes Megatron-LM's own optimizer's checkpoint vs Megatron-LM uninterrupted" \
    "$out/megatron_dist_opt.log" "$out/odo_resume_from_megatron.log" --first $((half + 1)) --skip $((half + 2))
verdict "(d) pretrain_gpt continues the imported ODO checkpoint vs uninterrupted" "$out/odo_launch.log" \
    "$out/pretrain_gpt_imported.log" --first $((half + 1))
verdict "(e) pretrain_gpt continues Megatron-LM's torch_dist checkpoint (its optimizer's state) vs uninterrupted" \
    "$out/megatron_dist_opt.log" "$out/pretrain_gpt_imported_torch_dist.log" --first $((half + 1))
verdict "(f) pretrain_gpt continues Megatron-LM's default (non-distributed) optimizer's torch_dist checkpoint vs \
uninterrupted" "$out/megatron_default_opt.log" "$out/pretrain_gpt_imported_default_opt.log" --first $((half + 1))
verdict "(h) ODO save (torch_dist) at $half and resume vs uninterrupted" "$out/odo_launch.log" \
    "$out/odo_dist_resume.log" --rtol 0 --first $((half + 1)) --skip $((half + 2))
verdict "(i) the ODO resumes Megatron-LM's default optimizer's torch_dist checkpoint vs its uninterrupted run" \
    "$out/megatron_default_opt.log" "$out/odo_resume_from_megatron_default.log" --first $((half + 1)) \
    --skip $((half + 2))
verdict "(j) Megatron-LM's own optimizer resumes the ODO's torch_dist checkpoint vs the ODO uninterrupted" \
    "$out/odo_launch.log" "$out/megatron_resume_from_odo_dist.log" --first $((half + 1)) --skip $((half + 2))
verdict "(k) the ODO resumes Megatron-LM's distributed optimizer's torch_dist checkpoint (dp_reshardable) vs \
Megatron-LM uninterrupted" "$out/megatron_dist_opt.log" "$out/odo_resume_from_megatron_dist.log" \
    --first $((half + 1)) --skip $((half + 2))
echo "logs: $out" >&2
exit $status
