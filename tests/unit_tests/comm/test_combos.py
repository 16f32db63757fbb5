"""The named backend combinations: settings and pretrain_gpt flags agree, unknown labels are rejected."""
import pytest

from megatron_ext.comm.combos import COMBOS, select_combos
from megatron_ext.training.arguments import parse_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10"]


@pytest.mark.parametrize("label", list(COMBOS))
def test_flags_parse_to_the_combination_settings(label):
    combo = COMBOS[label]
    args = parse_args(BASE + combo.flags() + ["--ranks-per-node", "2"], world_size=4)
    assert (args.grad_reduce, args.param_gather) == (combo.grad_reduce, combo.param_gather)
    if combo.grad_reduce == "qgz":
        assert args.qgz_bits == combo.qgz_bits


def test_select_combos_keeps_order_and_rejects_unknown_labels():
    assert [c.label for c in select_combos(["ByteGrad", "plain"])] == ["ByteGrad", "plain"]
    assert select_combos(None) == list(COMBOS.values())
    with pytest.raises(ValueError, match="qgZ INT2"):
        select_combos(["qgZ INT2"])
