"""The plug-in against a real Megatron-LM checkout (``MEGATRON_LM_PATH``; tag core_v0.16.1 matches the pinned
megatron-core). Skipped without one: CI has no checkout and nothing may be downloaded at test time. It checks every
name the plug-in patches or calls (megatron_lm/contract.py), that install() and uninstall() round-trip on the real
modules, and that the plug-in's flag checks run inside the checkout's own parse_args. The checkout's training code
needs extra packages (README: ``pip install six regex pydantic``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHECKOUT = os.environ.get("MEGATRON_LM_PATH")
pytestmark = pytest.mark.skipif(not CHECKOUT, reason="MEGATRON_LM_PATH does not name a Megatron-LM checkout "
                                "(e.g. tag core_v0.16.1); the real-checkout checks need one")

_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
out = {}
from megatron_ext.megatron_lm import contract
out["problems"] = contract.check()
import megatron.core.utils as cu
import megatron.training as mt
import megatron.training.arguments as margs
import megatron.training.checkpointing as ck
import megatron.training.training as tr
import megatron_ext.megatron_lm as mxlm
before = (tr.DDP, tr.get_megatron_optimizer, tr.unwrap_model, ck.unwrap_model, cu.unwrap_model)
mxlm.install()
out["patched"] = [tr.DDP is not before[0], tr.get_megatron_optimizer is not before[1],
                  all(getattr(m.unwrap_model, "original", None) is before[2] for m in (tr, ck, cu))]
mxlm.uninstall()
out["restored"] = (tr.DDP, tr.get_megatron_optimizer, tr.unwrap_model, ck.unwrap_model, cu.unwrap_model) == before
base = ["pretrain_gpt.py", "--use-distributed-optimizer", "--ckpt-format", "torch"]
sys.argv = base + ["--use-overlapped-distributed-optimizer", "--grad-reduce", "qgz", "--optim-shard-size", "2"]
a = margs.parse_args(extra_args_provider=mxlm.add_args)
out["parsed"] = [a.use_overlapped_distributed_optimizer, a.grad_reduce, a.optim_shard_size]
for bad in (["--use-overlapped-distributed-optimizer", "--ladder-residual"], ["--grad-reduce", "qgz"]):
    sys.argv = base + bad
    try:
        margs.parse_args(extra_args_provider=mxlm.add_args)
        out.setdefault("rejected", []).append(False)
    except SystemExit as e:
        out.setdefault("rejected", []).append(e.code == 2)
print("RESULT " + json.dumps(out))
"""


def test_plugin_against_the_checkout():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, CHECKOUT], capture_output=True, text=True, timeout=300,
                          env=env)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(line[len("RESULT "):])
    assert out["problems"] == [], out["problems"]
    assert out["patched"] == [True, True, True] and out["restored"]
    assert out["parsed"] == [True, "qgz", 2]
    assert out["rejected"] == [True, True]
