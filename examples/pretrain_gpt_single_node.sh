#!/usr/bin/env bash
# One node, 8 GPUs: TP=2 x DP=4, bf16, GPT ~1.3B, the OverlappedDistributedOptimizer with overlapped reduce-scatter
# and all-gather. Data: an indexed dataset from tools/preprocess_data.py, e.g.
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
#       --train-tokenizer-vocab-size 50257 --append-eod
#   DATA_PATH=data/corpus_text_document TOKENIZER=data/corpus_tokenizer.json bash examples/pretrain_gpt_single_node.sh
# NPROC=4 runs on 4 GPUs (TP=2 x DP=2); arguments after the script name are appended to the flags.
#
# CUDA_DEVICE_MAX_CONNECTIONS=1: with one hardware work queue per device, kernels start in the order they are
# issued. megatron-core's tensor-parallel layers rely on that to start a TP all-gather/reduce-scatter *before* the
# GEMM it should overlap (sequence parallelism, async TP communication), so Megatron-LM requires it whenever TP > 1.
# The price: the ODO's data-parallel reduce-scatters (issued from backward hooks when a bucket's last gradient
# arrives) and all-gathers (issued after the step, waited for by forward pre-hooks) also queue in issue order, so they
# overlap only the compute issued *after* them - which is exactly the order the ODO issues them in (bucket by bucket,
# in backward order). With TP = 1 you may leave the variable unset (several queues) and the DP collectives then
# overlap freely, at the cost of less predictable scheduling.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${DATA_PATH:?set DATA_PATH to an indexed dataset prefix (tools/preprocess_data.py output, without .bin/.idx)}"
: "${TOKENIZER:?set TOKENIZER to the tokenizer.json used by preprocess_data}"
CKPT=${CKPT:-checkpoints/gpt_1p3b_tp2_dp4}
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

exec torchrun --nproc-per-node "${NPROC:-8}" --standalone examples/pretrain_gpt.py \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 \
    --position-embedding-type rope --normalization RMSNorm --swiglu --ffn-hidden-size 5632 --disable-bias-linear \
    --untie-embeddings-and-output-weights \
    --micro-batch-size 4 --global-batch-size 256 \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel \
    --transformer-impl transformer_engine \
    --bf16 --optimizer adam --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 \
    --train-iters 100000 --log-interval 10 --eval-interval 1000 --eval-iters 20 \
    --use-distributed-optimizer --use-overlapped-distributed-optimizer \
    --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 40000000 \
    --data-path "$DATA_PATH" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" --split 969,30,1 \
    --save "$CKPT" --load "$CKPT" --save-interval 1000 \
    --tensorboard-dir "$CKPT/tensorboard" \
    "$@"
