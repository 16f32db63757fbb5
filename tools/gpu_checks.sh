#!/usr/bin/env bash
# The checks that need a GPU (CI has none): run them when one is at hand.
#   1. Every Triton kernel compiled for the GPU equals the torch reference bit for bit (tests/unit_tests/kernels/
#      triton_cases.py with MX_TEST_DEVICE=cuda; the same cases CI runs interpreted on CPU).
#   2. tools/bench_kernels.py on the GPU: each Triton kernel against the GPU's copy bandwidth (goal >= 80%), after
#      checking its output against the torch path on the same inputs; up to 4M elements also its host time per call.
#   3. pretrain_gpt on one GPU with NCCL, bf16 and the OverlappedDistributedOptimizer (overlapped reduce-scatter and
#      all-gather): 40 iterations saved at 20, then a resume from 20 that must log the same losses as the
#      uninterrupted run
#      (dropout on: the CUDA RNG states must come back too).
#   4. tools/trace_gpu_step.py: a 16-rank fake process group on the one GPU, progress engine inline and on a thread;
#      where the compute stream waits on communication (never in backward but for the buffer pool's handovers).
#   5. tools/train_sequence_resume.py: Megatron-LM's train() sequence around the ODO (a bf16 GPT with megatron-core's
#      compiled fusions), saved at 4 of 8 iterations and resumed: the losses bit for bit (this setting failed on an
#      H100 before the first-forward audit left compiled regions alone: docs/benchmarks/megatron_lm_check_h100_stop34.txt).
#
#   bash tools/gpu_checks.sh [OUT_DIR]          # writes logs and JSON into OUT_DIR (default: gpu_checks/)
#   MX_GPU_CHECKS=kernels,resume bash tools/gpu_checks.sh   # only these of: kernels, bench, trace, resume, replay
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_checks}
CHECKS=${MX_GPU_CHECKS:-kernels,bench,trace,resume,replay}
for c in ${CHECKS//,/ }; do
    case $c in kernels|bench|trace|resume|replay) ;;
        *) echo "MX_GPU_CHECKS: unknown check '$c' (kernels, bench, trace, resume, replay)" >&2; exit 2;; esac
done
wanted() { [[ ",$CHECKS," == *",$1,"* ]]; }
mkdir -p "$OUT"
failed=()
step() {  # step NAME CMD...: run CMD, keep its log, remember a failure and go on with the next check
    local name=$1; shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$OUT/$name.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("$name")
}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's package, installed or not (tools/ scripts import it)
nvidia-smi -L
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"

XDIST=(); python -c "import xdist" 2>/dev/null && XDIST=(-n 8)  # compiling the kernels' variants dominates: spread it
wanted kernels && step kernels_cuda env MX_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider \
    -W ignore::DeprecationWarning "${XDIST[@]}" tests/unit_tests/kernels/triton_cases.py
wanted bench && step bench_kernels python tools/bench_kernels.py --devices cuda --out "$OUT/bench_kernels_cuda.json"
wanted trace && step trace_gpu_step python tools/trace_gpu_step.py --engines inline,thread --steps 5 --check \
    --json "$OUT/gpu_trace.json"

resume_check() {  # 3. pretrain_gpt save at 20 and resume: the same losses
    CKPT=$(mktemp -d)
    GPT=(-m torch.distributed.run --nproc-per-node 1 --standalone -m megatron_ext.training.pretrain_gpt
         --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 512 --max-position-embeddings 512
         --micro-batch-size 8 --global-batch-size 32 --bf16
         --optimizer adam --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 5 --lr-decay-iters 40
         --weight-decay 0.1 --clip-grad 1.0 --log-interval 1 --eval-interval 1000 --eval-iters 1 --seed 1234
         --use-distributed-optimizer --use-overlapped-distributed-optimizer --overlap-grad-reduce
         --overlap-param-gather --ddp-bucket-size 10000000)
    step train_40 python "${GPT[@]}" --train-iters 40 --save "$CKPT/a" --save-interval 20
    step train_20 python "${GPT[@]}" --train-iters 20 --save "$CKPT/b"
    # the first half ran with --train-iters 20: take this run's (identical lr, longer weight-decay) schedule
    step resume_20_to_40 python "${GPT[@]}" --train-iters 40 --load "$CKPT/b" --save "$CKPT/b" \
        --override-opt_param-scheduler
    rm -rf "$CKPT"
    # the losses logged at iterations 21..40 by the uninterrupted run and by the resumed one
    losses() {
        grep -o "iteration *[0-9]*/.*lm loss: [0-9.E+-]*" "$OUT/$1.log" |
            sed -n 's/iteration *\([0-9]*\)\/.*lm loss: \([0-9.E+-]*\)/\1 \2/p' | awk '$1 > 20'
    }
    if [ -n "$(losses train_40)" ] && [ "$(losses train_40)" = "$(losses resume_20_to_40)" ]; then
        echo "resume: losses at iterations 21-40 equal the uninterrupted run's"
    else
        echo "!! resume: losses differ from the uninterrupted run (or were not logged)"; failed+=(resume_losses)
        paste <(losses train_40) <(losses resume_20_to_40)
    fi
}
wanted resume && resume_check
wanted replay && step train_sequence_resume python tools/train_sequence_resume.py --device cuda --layers 4 \
    --hidden 256 --seq 256 --vocab 1024 --iters 8 --out "$OUT/replay" --json "$OUT/train_sequence_resume.json"

echo
[ ${#failed[@]} -eq 0 ] && echo "all GPU checks passed" || { echo "FAILED: ${failed[*]}"; exit 1; }
