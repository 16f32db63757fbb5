"""Hand-written C for the one CPU op Inductor cannot make fast enough: INT4 dequantize-reduce-requantize (qgZ's
intra-node step). Its generated loop is bound by its instruction mix; the C (``csrc/int4_reduce.c``, which says how)
decodes a nibble with one vector permute over the group's 16 possible values. Same bits as the reference.

Built on first use with the system C compiler (``CC``, else ``cc``; the one Inductor needs anyway) for this CPU
(``-march=native``), cached in ``MX_KERNELS_CACHE`` (default ``~/.cache/megatron_ext/native``) under a hash of the
source, the flags and the CPU's feature flags, so a shared home directory on mixed nodes keeps one build per CPU kind.
Called through ``ctypes``, which releases the GIL: the progress engine's thread runs it beside backward.

Used only where a vector path is compiled in (AVX-512 F and BW, or AVX2) and ``MX_KERNELS_NATIVE`` is not ``0``;
elsewhere, or if the build fails (logged once), the compiled path runs Inductor's loop, which gives the same bits.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "int4_reduce.c"
MAX_K = 64  # chunks one call reduces: the build passes it to the source as MX_MAX_K (its stack arrays' size)
FLAGS = {  # variant -> compiler flags; "avx2" and "portable" (the scalar loop alone) exist for the tests
    "native": ["-O3", "-march=native"],
    "avx2": ["-O3", "-mavx2", "-mno-avx512f"],
    "portable": ["-O3", "-mno-avx512f", "-mno-avx2"],
}
_COMMON = ["-std=c11", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-fPIC", "-shared"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _cache_dir() -> Path:
    return Path(os.environ.get("MX_KERNELS_CACHE") or Path.home() / ".cache" / "megatron_ext" / "native")


def build(variant: str = "native") -> Path:
    """Compile the source for ``variant`` (cached; a build is written under a temporary name and renamed, so ranks
    building at once never load a partial file). Raises ``RuntimeError`` with the compiler's output on failure."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (set CC, or install cc/gcc)")
    flags = FLAGS[variant] + _COMMON + [f"-DMX_MAX_K={MAX_K}"]
    src = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, compiler.encode(), " ".join(flags).encode(), platform.machine().encode(),
                                     _cpu_flags().encode()])).hexdigest()[:20]
    lib = _cache_dir() / f"int4_reduce_{variant}_{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        res = subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"{compiler} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.lru_cache(maxsize=None)
def library(variant: str = "native") -> ctypes.CDLL | None:
    """The loaded library, or None (logged once) where it cannot be built or loaded."""
    try:
        lib = ctypes.CDLL(str(build(variant)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("megatron_ext.kernels: the native INT4 reduction is not available (%s); using the compiled "
                    "path", exc)
        return None
    fn = lib.mx_int4_reduce_quantize
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, ctypes.c_int, i64, i64, ptr, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.mx_isa.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether :func:`int4_reduce_quantize` runs vector code here (else the compiled path is as fast or faster)."""
    return os.environ.get("MX_KERNELS_NATIVE", "").strip() != "0" and _vector_build()


@functools.lru_cache(maxsize=None)
def _vector_build() -> bool:
    if sys.byteorder != "little" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    lib = library("native")
    return lib is not None and lib.mx_isa() in (256, 512)


def int4_reduce_quantize(chunks: torch.Tensor, scales: torch.Tensor, group_size: int, *, threads: int | None = None,
                         variant: str = "native") -> tuple[torch.Tensor, torch.Tensor]:
    """``dequantize_reduce_quantize`` for INT4 on CPU: ``chunks`` [k, bytes] uint8 and ``scales`` [k, groups] fp32,
    both contiguous (the caller checks them); returns (codes [bytes], scales [groups])."""
    lib = library(variant)
    if lib is None:
        raise RuntimeError(f"the native INT4 reduction ({variant}) could not be built: see the log")
    k, nbytes = chunks.shape
    groups = scales.shape[1]
    if k > MAX_K:
        raise ValueError(f"the native INT4 reduction takes at most {MAX_K} chunks, got {k}")
    codes = torch.empty(nbytes, dtype=torch.uint8)
    out_scales = torch.empty(groups, dtype=torch.float32)
    if groups:
        if threads is None:  # a thread per 256k output elements at most: below, starting one costs more
            threads = max(1, min(torch.get_num_threads(), groups * group_size >> 18))
        rc = lib.mx_int4_reduce_quantize(chunks.data_ptr(), nbytes, scales.data_ptr(), groups, k, groups,
                                         group_size // 2, codes.data_ptr(), out_scales.data_ptr(), threads)
        if rc:
            raise MemoryError(f"the native INT4 reduction failed (status {rc})")
    return codes, out_scales
