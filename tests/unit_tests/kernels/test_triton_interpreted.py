"""Runs ``triton_cases.py`` (Triton kernels == torch reference, bit for bit) in a subprocess under TRITON_INTERPRET=1.

[Note: why a subprocess]
Triton chooses between compiling and interpreting when a function is decorated with ``@triton.jit``, and that includes
the ``@jit`` helpers of ``triton.language`` itself, decorated when ``triton`` is first imported. Setting
``TRITON_INTERPRET=1`` inside a pytest process where anything already imported Triton leaves those helpers compiled
("Cannot call @triton.jit'd outside of the scope of a kernel"), and setting it process-wide would make every later
test module interpret its kernels. A child process with the variable set from the start avoids both.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("hypothesis")

_CASES = Path(__file__).with_name("triton_cases.py")
_TESTS_ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernels_match_reference_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("MX_KERNELS", None)
    # -n 0: one process (the outer suite already runs two workers; the file's cases would all go to one anyway)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-W",
           "ignore::DeprecationWarning", str(_CASES)]
    proc = subprocess.run(cmd, cwd=_TESTS_ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], tail
    print(proc.stdout.splitlines()[-1])
