"""Data order, the default corpus cache and the FLOP count behind the TFLOP/s log field."""
from __future__ import annotations

import argparse
import os

import pytest
import torch

from megatron_ext.training.data import MicroBatchIterator, train_valid_test_num_samples


class _Seq(torch.utils.data.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return {"tokens": torch.tensor([i])}


def _global_batches(dp, mbs, gbs, consumed, steps):
    """The samples each iteration sees across all DP ranks (as a sorted list per iteration)."""
    iters = [MicroBatchIterator(_Seq(), consumed, mbs, r, dp) for r in range(dp)]
    out = []
    for _ in range(steps):
        seen = []
        for _ in range(gbs // (mbs * dp)):
            for it in iters:
                seen += next(it)["tokens"].view(-1).tolist()
        out.append(sorted(seen))
    return out


def test_global_batches_do_not_depend_on_dp_size_or_resume_point():
    full = _global_batches(dp=4, mbs=2, gbs=16, consumed=0, steps=4)
    assert full == _global_batches(dp=2, mbs=2, gbs=16, consumed=0, steps=4)
    assert full == _global_batches(dp=1, mbs=4, gbs=16, consumed=0, steps=4)
    assert full[2:] == _global_batches(dp=2, mbs=4, gbs=16, consumed=32, steps=2)  # resumed after 2 iterations
    assert full[0] == list(range(16)) and full[1] == list(range(16, 32))


def test_num_samples():
    assert train_valid_test_num_samples(100, 8, 50, 2) == [800, 48, 16]
    assert train_valid_test_num_samples(100, 8, 50, 0) == [800, 0, 0]


def test_default_corpus_built_once_and_cached(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.training.corpus import build_default_corpus

    prefix, tok = build_default_corpus(str(tmp_path), vocab_size=300, max_bytes=150_000)
    stamp = os.path.getmtime(prefix + ".bin")
    again = build_default_corpus(str(tmp_path), vocab_size=300, max_bytes=150_000)
    assert again == (prefix, tok) and os.path.getmtime(prefix + ".bin") == stamp
    assert len(IndexedDataset(prefix)) > 3
    assert not [d for d in os.listdir(tmp_path) if ".tmp" in d]


def test_flop_count_matches_hand_count():
    from megatron_ext.training.logging_utils import num_floating_point_operations

    a = argparse.Namespace(hidden_size=64, num_layers=2, seq_length=32, num_attention_heads=4, kv_channels=None,
                           group_query_attention=False, num_query_groups=None, swiglu=False, ffn_hidden_size=256,
                           padded_vocab_size=512, vocab_size=500)
    h, s, L, f, V, b = 64, 32, 2, 256, 512, 3
    per_layer = 2 * (3 * h * h + h * h) + 2 * 2 * s * h / 2 + 2 * 2 * h * f  # fwd GEMMs per token, causal attention
    expected = 3 * b * s * (L * per_layer + 2 * h * V)
    assert abs(num_floating_point_operations(a, b) - expected) < 1e-6 * expected


def test_two_value_split_means_missing_entries_are_zero(text_dataset):
    """``--split 99,1`` / ``1,1`` (valid in Megatron-LM) used to index past the raw weights (IndexError)."""
    from megatron_ext.training.data import usable_split

    prefix, _ = text_dataset
    assert usable_split([prefix], "90,10", [100, 10, 0]) == "90,10,0"
    assert usable_split([prefix], "1,1", [100, 10, 0]) == "1,1,0"
    assert usable_split([prefix], "1", [100, 0, 0]) == "1,0,0"
    # 1% of 49 documents is none: dropped when no evaluation needs it, an error naming --split when one does
    assert usable_split([prefix], "99,1", [100, 0, 0]) == "99,0,0"
    with pytest.raises(ValueError, match="--split 99,1 leaves the validation split"):
        usable_split([prefix], "99,1", [100, 10, 0])


def test_log_line_averages_applied_iterations_only_and_shows_small_tflops():
    """Megatron-LM excludes skipped (fp16 overflow) iterations from the lm-loss average; TFLOP/s of a CPU run is
    small but not 0.000; the memory line leaves out what the plan does not hold."""
    from megatron_ext.training.logging_utils import format_memory_line, format_train_line
    from megatron_ext.training.loop import IntervalStats

    stats = IntervalStats()
    stats.add(9.0, False, None)          # overflow: skipped, its loss is not averaged
    stats.add(float("inf"), False, None)
    stats.add(3.0, True, 1.5)
    stats.add(5.0, True, 2.5)
    assert (stats.iters, stats.skipped, stats.nan, stats.lm_loss, stats.grad_norm) == (4, 2, 1, 4.0, 2.5)
    line = format_train_line(iteration=4, train_iters=10, consumed_samples=32, elapsed_ms=120.0,
                             tflops_per_rank=0.000123456, tokens_per_sec_per_rank=1000.0, lr=1e-3,
                             global_batch_size=8, lm_loss=stats.lm_loss, loss_scale=1.0, grad_norm=2.5, skipped=2,
                             nan_iters=1, intra_bytes=0, inter_bytes=0)
    assert "(TFLOP/s/GPU): 0.000123 |" in line and "lm loss: 4.000000E+00" in line
    assert "speculative" not in line and "num zeros" not in line and "params norm" not in line
    spec = format_train_line(iteration=4, train_iters=10, consumed_samples=32, elapsed_ms=120.0, tflops_per_rank=1.0,
                             tokens_per_sec_per_rank=1000.0, lr=1e-3, global_batch_size=8, lm_loss=4.0,
                             loss_scale=1.0, grad_norm=2.5, skipped=0, nan_iters=0, intra_bytes=0, inter_bytes=0,
                             speculative=(3, 1), num_zeros=7, params_norm=123.4567)
    assert "| speculative steps committed: 3/4 |" in spec
    assert "| grad norm: 2.500 | num zeros: 7.0 | params norm: 123.457 |" in spec   # Megatron-LM's order and format
    mb = 1024 * 1024
    memory = format_memory_line(3, 10, {"parameters": 3 * mb, "hpz_secondary": 0, "gradients": mb // 2,
                                        "optimizer_states": 6 * mb}, {"allocated": 20 * mb})
    assert memory == ("[Rank 3] (after 10 iterations) model-state memory (MB) | parameters: 3.0 | gradients: 0.5 | "
                      "optimizer states: 6.0 | total: 9.5 | allocated: 20.0")


def test_eod_mask_loss_and_reset_position_ids_reach_the_dataset(text_dataset, tmp_path):
    """--eod-mask-loss: no loss on end-of-document tokens; --reset-position-ids: positions restart after each one
    (megatron-core's GPTDataset options); without them, every token counts and positions run 0..s-1."""
    import torch

    from megatron_ext.training.data import build_datasets
    from megatron_ext.training.tokenizer import load_tokenizer

    prefix, tok_json = text_dataset
    tok = load_tokenizer("HuggingFaceTokenizer", tokenizer_model=tok_json)
    seq = 256

    def first_samples(**kw):
        train = build_datasets([prefix], "100,0,0", seq, 1234, tok, [64, 0, 0], cache_dir=str(tmp_path), **kw)[0]
        return [train[i] for i in range(64)]

    plain, masked = first_samples(), first_samples(eod_mask_loss=True, reset_position_ids=True)
    eod_seen = 0
    for p, m in zip(plain, masked):
        assert torch.equal(p["tokens"], m["tokens"])
        at_eod = m["tokens"] == tok.eod
        eod_seen += int(at_eod.sum())
        assert bool((p["loss_mask"] == 1).all()) and torch.equal(p["position_ids"], torch.arange(seq))
        assert bool((m["loss_mask"][at_eod] == 0).all()) and bool((m["loss_mask"][~at_eod] == 1).all())
        for i in at_eod.nonzero().flatten().tolist():   # the token after an EOD starts again at position 0
            if i + 1 < seq:
                assert m["position_ids"][i + 1] == 0
    assert eod_seen > 0


def _logged_bytes():
    import torch.distributed as dist

    from megatron_ext.training.loop import mean_bytes_per_rank

    class Ledger:   # ranks that send unevenly, as ring's and ByteGrad's hops make them
        def summary(self):
            r = dist.get_rank()
            return {"total": {"intra": 100 * (r + 1), "inter": 1000 * (3 - r)}}

    return mean_bytes_per_rank([Ledger()], iters=2)


def test_logged_bytes_are_the_mean_over_every_rank(spawn):
    """The log line's bytes per step are every rank's mean (the last rank alone misread ring and ByteGrad)."""
    for intra, inter in spawn(_logged_bytes, 2):
        assert (intra, inter) == ((100 + 200) / 2 / 2, (3000 + 2000) / 2 / 2)
