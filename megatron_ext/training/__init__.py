"""pretrain_gpt: train a megatron-core GPT with the OverlappedDistributedOptimizer from Megatron-LM's flags.

Entry point: ``torchrun ... -m megatron_ext.training.pretrain_gpt --help`` (or ``examples/pretrain_gpt.py``).

Files, one job each:

* ``arguments.py``     flags (Megatron-LM names + ours), strict validation with messages that name the flag
* ``auto_plan.py``     ``--auto-plan``: the planner's choice of sharding plan, backends and bucket size, as flags
* ``tokenizer.py``     byte-level BPE (trained locally or GPT-2 vocab/merges), NullTokenizer
* ``preprocess.py``    text/JSONL -> megatron-core indexed dataset (used by tools/preprocess_data.py)
* ``corpus.py``        the default corpus: the Python standard library's sources, built once and cached
* ``data.py``          megatron-core GPTDataset via BlendedMegatronDatasetBuilder; resumable micro-batch order
* ``model.py``         this rank's GPTModel stage from the flags (Float16Module for bf16/fp16, Ladder option)
* ``initialize.py``    process group, megatron-core parallel state, seeds
* ``loop.py``          train_step / evaluate / train on megatron-core's forward-backward schedules
* ``logging_utils.py`` Megatron-style log lines, FLOP count, TensorBoard
* ``checkpointing.py`` atomic, reshardable checkpoints; loads agreed by all ranks before anything is applied
* ``checkpoint_compat.py`` does a checkpoint fit this run (model flags, shapes, optimizer state, LR schedule)
* ``checkpoint_reshard.py`` a checkpoint rewritten for other TP/PP sizes (tools/reshard_checkpoint.py)
* ``checkpoint_import.py`` a Megatron-LM checkpoint as a pretrain_gpt one (tools/import_megatron_lm_checkpoint.py)
* ``pipeline_layout.py`` which layers each pipeline stage and model chunk holds (even or Megatron-LM's uneven split)
* ``batch_size.py``    ``--rampup-batch-size``: the global batch size at each consumed sample, train iterations
* ``notices.py``       megatron-core's known fallback warnings shown once, on rank 0 (a quiet first screen)
* ``pretrain_gpt.py``  wires the above together

[Note: what runs on CPU/gloo, and the limits]
TP, PP and DP run together on CPU gloo (tests: TP=2 x DP=2, PP=2 x DP=2 with one and two chunks per stage; the
main job DP=4 on 2 simulated nodes). megatron-core 0.16 needs CUDA in a few places on this path;
``megatron_ext.compat.enable_cpu_compat`` routes around them, and ``model.py`` builds the GPT under
``cpu_device_mode`` because with PP > 1 and tied embeddings ``LanguageModule.setup_embeddings_and_output_layer``
calls ``weight.data.cuda()``. Limits, with the reasons:

* ``--sequence-parallel`` needs ``--transformer-impl transformer_engine``: megatron-core's local layer spec
  (``WrappedTorchNorm``) raises "sequence parallel not supported by torch LayerNorm"; TE does not run on CPU.
* Interleaved (virtual) pipelines run as in Megatron-LM: ``model`` is the list of the stage's chunks, each its own
  OverlappedDDP under one ODO, with one data iterator per chunk. Context parallelism and MoE are rejected by name.
* Checkpoints reshard across DP sizes, bucket sizes and backends; TP/PP must match the saving run (model and
  optimizer files are per TP/PP position). RNG streams are restored only at the same world size.
* Multi-node runs need a filesystem shared by all nodes for ``--save``/``--load`` and for megatron-core's dataset
  index cache (as with Megatron-LM); the default corpus is built once per node.
* The "bytes sent per step" of the log are the collectives of the ODO as counted by its ledger (per rank,
  intra-/inter-node); megatron-core's own TP and PP traffic is not in the ledger.
"""
