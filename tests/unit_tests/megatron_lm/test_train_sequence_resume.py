"""Megatron-LM's ``train()`` sequence around the ODO resumes bit for bit (``tools/train_sequence_resume.py``): what
``tools/megatron_lm_check.sh`` check (b) asks of a real checkout on GPUs, replayed on CPU without Megatron-LM.

On an H100 that check failed: the ODO's first-forward audit changed how megatron-core's compiled fusions ran from
the audited forward on, and a resumed run is audited at another iteration than a fresh one
(``docs/benchmarks/megatron_lm_check_h100_stop34.txt``). Each compiled fusion is called 8 times per iteration here
(4 layers x 2 micro-batches); a recompile limit of 4 lets a per-call recompile exhaust Dynamo's limit within one
audited forward, as the default of 8 does on a deeper model: with the old audit this test fails.
"""
import json
import subprocess
import sys

from ..tool_loader import TOOLS


def test_megatron_lm_train_sequence_resumes_bit_for_bit(tmp_path):
    out = tmp_path / "resume.json"
    res = subprocess.run([sys.executable, str(TOOLS / "train_sequence_resume.py"), "--in-process", "--recompile-limit",
                          "4", "--out", str(tmp_path / "runs"), "--json", str(out)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    got = json.loads(out.read_text())
    assert got["verdict"] == "pass" and "PASS (bit for bit)" in res.stdout
    full, saved, resumed = (got["runs"][k] for k in ("full", "save", "resume"))
    assert [it for it, _ in full] == [1, 2, 3, 4] and saved == full[:2] and resumed == full[2:]
