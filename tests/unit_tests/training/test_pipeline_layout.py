"""megatron_ext.training.pipeline_layout places layers exactly as megatron-core builds them."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_ext.training.pipeline_layout import PipelineLayout


def _core(num_layers, pp, vp, first, last, emb, loss):
    """megatron-core's (offset, count) per (stage, chunk), from a config carrying only the fields they read."""
    cfg = SimpleNamespace(num_layers=num_layers, pipeline_model_parallel_size=pp, pipeline_model_parallel_layout=None,
                          virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                          num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                          account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss)
    vps = cfg.virtual_pipeline_model_parallel_size
    return {(s, c): (get_transformer_layer_offset(cfg, vp_stage=c if vps else None, pp_rank=s),
                     get_num_layers_to_build(cfg, vp_stage=c if vps else None, pp_rank=s))
            for s in range(pp) for c in range(vp)}


def test_every_valid_layout_matches_megatron_core():
    """Every combination of up to 12 layers, 4 stages and 3 chunks that the layout accepts: each chunk's offset and
    layer count are megatron-core's, and the chunks cover every layer once."""
    checked = set()
    for L, pp, vp in itertools.product(range(1, 13), range(1, 5), range(1, 4)):
        for first, last in itertools.product([None, 1, 2, 3, 4], repeat=2):
            for emb, loss in itertools.product([False, True], repeat=2):
                try:
                    lay = PipelineLayout(L, pp, vp, first, last, emb, loss)
                except ValueError:
                    continue
                want = _core(L, pp, vp, first, last, emb, loss)
                got = {(s, c): (lay.offset(s, c), lay.count(s, c)) for s in range(pp) for c in range(vp)}
                assert got == want, (L, pp, vp, first, last, emb, loss)
                assert sorted(o + j for o, n in got.values() for j in range(n)) == list(range(L))
                for layer in range(L):
                    s, c, j = lay.where(layer)
                    assert lay.offset(s, c) + j == layer and j < lay.count(s, c)
                checked.add((first is not None or last is not None, emb or loss, vp > 1))
    assert len(checked) == 6, checked   # uneven and accounted splits, each with and without chunks, were met


def test_examples_and_refusals():
    lay = PipelineLayout(8, 3, 1, first=2, last=2)   # the middle stage takes the other 4
    assert lay.counts() == "2 4 2" and [lay.offset(s) for s in range(3)] == [0, 2, 6]
    lay = PipelineLayout(7, 2, 2, account_for_embedding=True)   # 8 slots: stage 0 chunk 0 gives one to the embedding
    assert [(lay.offset(s, c), lay.count(s, c)) for c in range(2) for s in range(2)] == [(0, 1), (1, 2), (3, 2),
                                                                                         (5, 2)]
    assert PipelineLayout(8, 2).even and not PipelineLayout(8, 2, first=4).even
    lay = PipelineLayout(6, 2, 4, account_for_embedding=True, account_for_loss=True)   # Megatron-LM's standalone
    assert lay.counts() == "0+1+1+1 1+1+1+0"   # embedding and loss chunks: megatron-core builds them layer-less
    for kwargs, match in (
            (dict(num_layers=8, pp=3), r"--num-layers \(8\) must be divisible by --pipeline-model-parallel-size \(3\)"),
            (dict(num_layers=8, pp=2, account_for_loss=True),
             r"--num-layers \(8 \+ 1 for --account-for-loss-in-pipeline-split\) must be divisible"),
            (dict(num_layers=8, pp=3, first=3), r"leaves 5 layers for the 2 other pipeline stages"),
            (dict(num_layers=8, pp=2, first=3, last=3), r"leaves 2 layers for the 0 other pipeline stages"),
            (dict(num_layers=8, pp=1, first=3), r"need --pipeline-model-parallel-size > 1"),
            (dict(num_layers=8, pp=2, first=0), r"--decoder-first-pipeline-num-layers must be positive, got 0"),
            (dict(num_layers=8, pp=2, first=3, account_for_embedding=True), r"conflict with"),
            (dict(num_layers=9, pp=2, vp=2, first=3), r"stage 0 holds 3 layers, not divisible by its 2 model chunks"),
            (dict(num_layers=4, pp=2, vp=2, first=2, last=2), r"together with --num-virtual-stages-per-pipeline-rank")):
        with pytest.raises(ValueError, match=match):
            PipelineLayout(**kwargs)


def _layers_saved(ckpt, stage):
    import glob
    import os
    import re

    import torch

    (path,) = glob.glob(os.path.join(ckpt, "iter_*", f"mp_rank_00_{stage:03d}", "model.pt"))
    keys = torch.load(path, map_location="cpu", weights_only=False)
    return sorted({int(m[1]) for k in keys if (m := re.match(r"decoder\.layers\.(\d+)\.", k))})


def test_uneven_stages_train_resume_and_reshard(spawn, text_dataset, tiny_model_flags, tmp_path, capsys):
    """PP 2 with --decoder-first-pipeline-num-layers 1 (stage 0 builds layer 1, stage 1 layers 2-4) trains like the
    even split from the same weights; its checkpoint resumes to the same losses, an even-split resume is refused by
    name, and tools/reshard_checkpoint.py --target-even-pipeline-split rewrites it into one the even split resumes.
    With both --account-for-... flags and a layer per chunk, the first and last chunks hold only the embedding and
    the loss (Megatron-LM's standalone stages), and train like the even split too.
    Bits may differ from the even run only through the grad norm's sums over other partitions (fp32 rounding):
    1e-6 relative (equal bits were seen); a wrong placement builds another model and misses by far more."""
    from .test_checkpoint_reshard import _reshard
    from .test_pretrain_gpt import _data_flags, _runs_from_one_init

    ckpt, even_ckpt = str(tmp_path / "ckpt"), str(tmp_path / "even")
    base = tiny_model_flags[2:] + _data_flags(text_dataset) + [
        "--num-layers", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--train-iters", "4"]
    uneven = base + ["--decoder-first-pipeline-num-layers", "1"]
    standalone = base + ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                         "--num-layers-per-virtual-pipeline-stage", "1"]   # 3 chunks a stage: 0+1+1 and 1+1+0 layers
    even, first, resumed, refused, alone = spawn(_runs_from_one_init, 2, [
        base, uneven + ["--save", ckpt, "--save-interval", "2", "--exit-interval", "2"], uneven + ["--load", ckpt],
        base + ["--load", ckpt], standalone], timeout=300)[-1]
    assert _layers_saved(ckpt, 0) == [0] and _layers_saved(ckpt, 1) == [0, 1, 2]
    assert "the layers per pipeline stage: checkpoint 1 3, this run 2 2" in refused, refused
    capsys.readouterr()
    assert _reshard(ckpt, str(tmp_path / "bad"), 1, 2, "--target-decoder-first-pipeline-num-layers", "5") == 1
    assert "--target-decoder-first-pipeline-num-layers 5 place more layers than --num-layers 4" in \
        capsys.readouterr().err
    assert _reshard(ckpt, even_ckpt, 1, 2, "--target-even-pipeline-split") == 0
    assert _layers_saved(even_ckpt, 0) == [0, 1] and _layers_saved(even_ckpt, 1) == [0, 1]
    (from_even,) = spawn(_runs_from_one_init, 2, [base + ["--load", even_ckpt]], timeout=200)[-1]
    assert sorted(first["losses"]) == [1, 2] and sorted(resumed["losses"]) == sorted(from_even["losses"]) == [3, 4]
    for i, want in even["losses"].items():
        got = {**first["losses"], **resumed["losses"]}[i]
        assert abs(got - want) <= 1e-6 * abs(want), (i, got, want)
        if i > 2:
            assert abs(from_even["losses"][i] - want) <= 1e-6 * abs(want), (i, from_even["losses"][i], want)
        assert abs(alone["losses"][i] - want) <= 1e-6 * abs(want), (i, alone["losses"][i], want)


@pytest.mark.parametrize("extra,message", [
    (["--decoder-first-pipeline-num-layers", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
     "--num-layers-per-virtual-pipeline-stage does not fit uneven pipeline stages"),
    (["--decoder-first-pipeline-num-layers", "3", "--num-virtual-stages-per-pipeline-rank", "2"],
     "pipeline stage 0 holds 3 layers, not divisible by its 2 model chunks"),
    (["--num-layers", "7", "--account-for-loss-in-pipeline-split", "--num-layers-per-virtual-pipeline-stage", "3"],
     r"--num-layers-per-virtual-pipeline-stage \(3\) must divide the layers per pipeline stage \(4, counting"),
    (["--decoder-last-pipeline-num-layers", "6", "--auto-plan", "--plan-hardware", "dgx-a100"],
     "--auto-plan plans even pipeline stages"),
    (["--decoder-first-pipeline-num-layers", "5", "--decoder-last-pipeline-num-layers", "5"],
     "place more layers than --num-layers 8"),
    (["--decoder-first-pipeline-num-layers", "6", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "7"], r"between 1 and the layers per pipeline stage \(6\)"),
])
def test_pretrain_gpt_names_the_split_flags(capsys, extra, message):
    import re

    from megatron_ext.training.arguments import parse_args

    from .test_arguments import BASE, PP2_8

    with pytest.raises(SystemExit):
        parse_args(BASE + PP2_8 + ["--global-batch-size", "8"] + extra, world_size=4)
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_pretrain_gpt_split_reaches_megatron_core():
    from megatron_ext.training.arguments import parse_args
    from megatron_ext.training.model import config_overrides

    from .test_arguments import BASE, PP2_8

    args = parse_args(BASE + PP2_8 + ["--global-batch-size", "8", "--decoder-last-pipeline-num-layers", "2",
                                      "--num-virtual-stages-per-pipeline-rank", "2"], world_size=4)
    over = config_overrides(args)
    assert (over["num_layers_in_first_pipeline_stage"], over["num_layers_in_last_pipeline_stage"]) == (None, 2)
    assert args.virtual_pipeline_model_parallel_size == 2
