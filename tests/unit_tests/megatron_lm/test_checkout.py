"""The plug-in against a real Megatron-LM checkout (``MEGATRON_LM_PATH``; tag core_v0.16.1 matches the pinned
megatron-core). Skipped without one: CI has no checkout and nothing may be downloaded at test time. It checks every
name the plug-in patches or calls (megatron_lm/contract.py), that install() and uninstall() round-trip on the real
modules (the checkpointing module's dist_checkpointing too, which install() wraps), that the plug-in's flag checks run inside the checkout's own parse_args, and that the commands of
tools/megatron_lm_check.sh pass its validate_args and build a model that runs forward and backward on CPU. The
checkout's training code needs extra packages (README: ``pip install six regex pydantic``)."""
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
before = (tr.DDP, tr.get_megatron_optimizer, tr.unwrap_model, ck.unwrap_model, cu.unwrap_model,
          ck.dist_checkpointing)
mxlm.install()
out["patched"] = [tr.DDP is not before[0], tr.get_megatron_optimizer is not before[1],
                  all(getattr(m.unwrap_model, "original", None) is before[2] for m in (tr, ck, cu)),
                  getattr(ck.dist_checkpointing, "wrapped", None) is before[5]]
mxlm.uninstall()
out["restored"] = (tr.DDP, tr.get_megatron_optimizer, tr.unwrap_model, ck.unwrap_model, cu.unwrap_model,
                   ck.dist_checkpointing) == before
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
    assert out["patched"] == [True, True, True, True] and out["restored"]
    assert out["parsed"] == [True, "qgz", 2]
    assert out["rejected"] == [True, True]


_RUNS_SCRIPT = r"""
import json, os, socket, sys
sys.path.insert(0, sys.argv[1])
runs = json.loads(sys.stdin.read())
import torch
import megatron_ext.megatron_lm as mxlm
from megatron.training.arguments import parse_args, validate_args
out = {}
for name, argv in runs:
    sys.argv = ["pretrain_gpt.py"] + argv
    try:
        validate_args(parse_args(extra_args_provider=mxlm.add_args))
        out[name] = "ok"
    except BaseException as e:  # an AssertionError, or SystemExit from argparse
        out[name] = f"{type(e).__name__}: {e}"
# the model the runs train, built by the checkout's own provider, one forward and backward on CPU
from megatron.training.global_vars import set_global_variables
from megatron_ext.compat import enable_cpu_compat
sys.argv = ["pretrain_gpt.py"] + runs[0][1]
args = parse_args(extra_args_provider=mxlm.add_args)
validate_args(args)
args.use_cpu_initialization, args.padded_vocab_size = True, 1024   # NullTokenizer's 1023 + 1, padded as Megatron pads
set_global_variables(args, build_tokenizer=False)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
from megatron.core import parallel_state
parallel_state.initialize_model_parallel()
enable_cpu_compat()
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
model_parallel_cuda_manual_seed(args.seed)
from gpt_builders import gpt_builder
from model_provider import model_provider
from megatron.core.transformer.module import Float16Module
model = model_provider(gpt_builder, pre_process=True, post_process=True)
ids = torch.randint(0, 1023, (args.micro_batch_size, args.seq_length))
pos = torch.arange(args.seq_length).expand(args.micro_batch_size, -1)
loss = Float16Module(model.config, model)(ids, pos, None, labels=ids)
loss.float().mean().backward()
out["model"] = [type(model).__name__, all(p.grad is not None or getattr(p, "main_grad", None) is not None
                                          for p in model.parameters())]
print("RESULT " + json.dumps(out))
"""


def test_check_script_runs_parse_and_build_in_the_checkout(tmp_path):
    """Every command tools/megatron_lm_check.sh runs passes the checkout's parse_args and validate_args, and its model
    builds and runs forward and backward on CPU: the two things its first GPU run tripped on (a resume with --save
    but no --save-interval; the local transformer's fused LayerNorm and softmax, which need Apex) cost no GPU time."""
    from .check_script import dry_runs

    # (checks (d), (e) and (f)'s import and pretrain_gpt runs are this package's: test_check_verdicts parses them)
    ours = ("import_ckpt", "pretrain_gpt_imported", "import_torch_dist", "pretrain_gpt_imported_torch_dist",
            "import_default_opt", "pretrain_gpt_imported_default_opt")
    runs = [r for r in dry_runs(CHECKOUT, tmp_path / "out") if r[0] not in ours]
    env = dict(os.environ, PYTHONWARNINGS="ignore", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    proc = subprocess.run([sys.executable, "-c", _RUNS_SCRIPT, CHECKOUT], input=json.dumps(runs),
                          capture_output=True, text=True, timeout=300, env=env)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(line[len("RESULT "):])
    assert {name: out[name] for name, _ in runs} == {name: "ok" for name, _ in runs}
    assert out["model"] == ["GPTModel", True]
