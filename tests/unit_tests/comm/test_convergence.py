"""Convergence of the quantized backends: a small megatron-core GPT trained for 100 steps on real text with
pretrain_gpt, DP=4 on 2 simulated nodes, reaches a final loss within 2% of the plain backend's with qwZ, qgZ INT4
and ByteGrad, each paired with qwZ (the issue's criterion; seed 000 Table 5: +2.1% with all of ZeRO++ on).

[Note: why the comparison is not chaotic]
Every combo starts from the same weights (same --seed) and sees the same batches in the same order, so the only
difference is the backend. The learning rate (1e-3, 10 warmup steps, cosine to 1e-4) keeps the runs on the smooth
part of the curve; at a high learning rate, when a 200-step run leaves its early plateau depends on tiny
perturbations and a quantized run can end several percent above or below plain by chance (the note in
tools/bench_convergence.py). The final
loss is the mean over the last 20 steps (160 sequences), which averages out batch-to-batch noise.

Quantization groups of 128 elements (``--quant-group-size``), about one row of this 64-wide model's matrices --
DeepSpeed's qgZ likewise uses one group per row (``max(shape)`` groups per tensor). With the default 2048 a group
spans 32 rows, small rows share a scale with the largest, and INT4 gradients cost this tiny GPT +2.3%.

Measured at 100 steps, the suite's length (final loss vs plain, seed 1234 / seed 4321): qwZ+qgZ INT4 +0.12 /
-0.09%, qwZ+ByteGrad -0.13 / -0.25%: the 2% criterion has a margin of 8x; plain's final loss, 5.32 / 5.33 from 6.24,
is 0.91 below its first (the learning check asks 0.6; a run that does not learn stays near ln(512) = 6.24). At 150
steps (the length until the suite's budget cut it again): qwZ -0.02 / +0.03%, qgZ INT4 +0.59 / +0.35%, qgZ INT8
+0.00 / -0.01%, ByteGrad -0.06 / -0.30%, qwZ+qgZ INT4 +0.59 / +0.34%, qwZ+qgZ INT8 +0.02 / +0.04%, qwZ+ByteGrad
-0.05 / -0.28%; at 200 steps at most +0.50% for any combination. The whole module (3 runs in one gloo world of 4
ranks; ``TESTED`` says which) takes about 40 s of wall time on 2 cores alone.
"""
from __future__ import annotations

import contextlib
import io
import logging

import pytest

from megatron_ext.comm.combos import COMBOS
from unit_tests.dist_harness import run_distributed
from unit_tests.training.conftest import text_dataset  # noqa: F401 - the real-text dataset fixture, reused

STEPS, FINAL_WINDOW, TOLERANCE = 100, 20, 0.02
# For the suite's 10-minute budget (a 100-step run is about 13 s alone, 20 s beside the other worker), every backend
# runs in a pairing with qwZ: qwZ + qgZ INT4 (the headline) and qwZ + ByteGrad. A pairing's loss tracks its gradient
# half (module note, 150 steps: ByteGrad -0.06 / -0.30% alone, -0.05 / -0.28% with qwZ; qgZ INT4 +0.59 / +0.35%
# alone, +0.59 / +0.34% with qwZ; qwZ alone -0.02 / +0.03%), and ``test_both_halves_of_a_pairing_are_engaged`` proves
# neither half was silently off. Left out: the backends alone, qgZ INT8 (the INT4 path with 8-bit codes; +0.00 /
# -0.01% at 150 steps) and ring, plain's sum in another order (its backend test holds it to the exact average within
# fp32 rounding); tools/bench_convergence.py runs all of them (measured in the module note).
TESTED = ["plain", "qwZ+qgZ INT4", "qwZ+ByteGrad"]
QUANT_GROUP = 128


def _model_flags(data_prefix: str, tokenizer: str) -> list:
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "10",
            "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--clip-grad", "1.0", "--weight-decay", "0.01",
            "--seed", "1234", "--train-iters", str(STEPS), "--eval-iters", "0", "--log-interval", str(STEPS),
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
            "--ddp-bucket-size", "1000000", "--ranks-per-node", "2",
            "--data-path", data_prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer,
            "--split", "100,0,0"]


def _combo_flags(label: str) -> list:
    combo = COMBOS[label]
    quantized = combo.grad_reduce == "qgz" or combo.param_gather == "qwz"
    quant = ["--quant-group-size", str(QUANT_GROUP)] if quantized else []
    return [*combo.flags(), *quant]


def _train_every_combo(base: list) -> dict:
    """Rank body: pretrain_gpt once per combo in this world; the per-step lm loss (averaged over the DP group) and
    the last logged interval's inter-node bytes per step."""
    from megatron_ext.training.pretrain_gpt import pretrain

    logging.getLogger("megatron_ext").setLevel(logging.ERROR)
    losses, inter = {}, {}
    for label in TESTED:
        with contextlib.redirect_stdout(io.StringIO()):
            result = pretrain(base + _combo_flags(label))
        losses[label] = [result["losses"][i] for i in sorted(result["losses"])]
        inter[label] = result["log"][STEPS]["inter_bytes"]
    return {"losses": losses, "inter_bytes": inter}


@pytest.fixture(scope="module")
def runs(text_dataset):  # noqa: F811
    prefix, tokenizer = text_dataset
    result = run_distributed(_train_every_combo, 4, _model_flags(prefix, tokenizer), timeout=900)[-1]
    print("\n" + _table(result["losses"]), result["inter_bytes"])   # shown with pytest -s
    return result


@pytest.fixture(scope="module")
def losses(runs):
    return runs["losses"]


def _final(curve: list) -> float:
    return sum(curve[-FINAL_WINDOW:]) / FINAL_WINDOW


def _table(losses: dict) -> str:
    base = _final(losses["plain"])
    return "\n".join(f"  {k:<13} first {v[0]:.4f}  final {_final(v):.4f}  {(_final(v) / base - 1) * 100:+.2f}%"
                     for k, v in losses.items())


def test_plain_run_learns(losses):
    """The comparison means something only if the model learns: well below the uniform-guess loss ln(512) ~ 6.2.
    0.6 below the first loss: the 100-step runs end 0.91 below it (6.24 -> 5.32 / 5.33 on two seeds), and a run that
    does not learn stays near ln(512); the 0.3 margin either side covers another torch's or BLAS's rounding."""
    curve = losses["plain"]
    assert len(curve) == STEPS
    assert _final(curve) < curve[0] - 0.6, (curve[0], _final(curve))


@pytest.mark.parametrize("label", [c for c in TESTED if c != "plain"])
def test_final_loss_within_2_percent_of_plain(losses, label):
    assert len(losses[label]) == STEPS
    assert losses[label] != losses["plain"], f"{label}: the backend changed nothing (not engaged?)"
    rel = _final(losses[label]) / _final(losses["plain"]) - 1
    assert abs(rel) <= TOLERANCE, f"{label}: final loss {rel * 100:+.2f}% vs plain (limit 2%)\n{_table(losses)}"


def test_both_halves_of_a_pairing_are_engaged(runs):
    """Plain's inter-node bytes per step are its fp32 reduce-scatter and its fp32 all-gather, the same shards both
    ways (equal halves), plus a few scalars. A pairing with one half not engaged would send that half's fp32 bytes,
    half of plain's, on top of the other's; both halves compressed send well under it (measured: 0.16 and 0.19 of
    plain for qwZ + qgZ INT4 and qwZ + ByteGrad)."""
    inter = runs["inter_bytes"]
    for label in TESTED[1:]:
        assert 0 < inter[label] < inter["plain"] / 2, (label, inter)
