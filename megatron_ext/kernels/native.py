"""Hand-written C for the CPU ops Inductor cannot make fast enough, with the reference's bits:

* INT4 dequantize-reduce-requantize (qgZ's intra-node step, ``csrc/int4_reduce.c``): Inductor's loop is bound by
  its instruction mix; on AVX-512 the C decodes a nibble with one vector permute over the group's 16 possible
  values, on AVX2 by arithmetic (shifts, a conversion and the table's multiply).
* The fp32 codecs (``csrc/codec.c``: symmetric quantize / dequantize, the k-chunk dequantize-reduce, ByteGrad's
  k-row min-max decode-and-average, whose one row is the min-max dequantize): on AVX2 Inductor's integer loads go
  through ATen's slow partial-load path (the file says how); plain loops vectorised by the C compiler run at memory
  speed, and a call costs microseconds instead of a graph's ~0.25 ms.

Built on first use with the system C compiler (``CC``, else ``cc``; the one Inductor needs anyway) for this CPU
(``-march=native``), both sources into one library, cached in ``MX_KERNELS_CACHE`` (default
``~/.cache/megatron_ext/native``) under a hash of the sources, the flags and the CPU's feature flags, so a shared home
directory on mixed nodes keeps one build per CPU kind. Called through ``ctypes``, which releases the GIL: the
progress engine's thread runs them beside backward.

Used only where a vector path is compiled in (AVX-512 F and BW, or AVX2) and ``MX_KERNELS_NATIVE`` is not ``0``;
elsewhere, or if the build fails (logged once), the compiled path runs Inductor's loops (from ``MIN_NUMEL`` elements
in its automatic mode, the eager reference below), which give the same bits.
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

SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("int4_reduce.c", "codec.c"))
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
    parts = [*(src.read_bytes() for src in SOURCES), compiler.encode(), " ".join(flags).encode(),
             platform.machine().encode(), _cpu_flags().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
    lib = _cache_dir() / f"mx_kernels_{variant}_{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        res = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True)
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
        log.warning("megatron_ext.kernels: the native kernels are not available (%s); using the compiled path", exc)
        return None
    i64, ptr, int_ = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    signatures = {  # name -> (argument types, return type)
        "mx_int4_reduce_quantize": ([ptr, i64, ptr, i64, int_, i64, i64, ptr, ptr, int_], int_),
        "mx_quantize": ([ptr, i64, i64, i64, int_, ptr, ptr, int_], None),
        "mx_dequantize_reduce": ([ptr, i64, ptr, i64, int_, i64, i64, int_, ctypes.c_float, ptr, int_], None),
        "mx_dequantize_minmax_reduce": ([ptr, i64, ptr, ptr, i64, int_, i64, i64, ctypes.c_float, ptr, int_], None),
        "mx_isa": ([], int_),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def available() -> bool:
    """Whether the library runs vector code here (else Inductor's loops are as fast or faster): the compiled path then
    routes the INT4 reduction and the fp32 codecs to it."""
    return os.environ.get("MX_KERNELS_NATIVE", "").strip() != "0" and _vector_build()


@functools.lru_cache(maxsize=None)
def _vector_build() -> bool:
    if sys.byteorder != "little" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    lib = library("native")
    return lib is not None and lib.mx_isa() in (256, 512)


def _lib(variant: str) -> ctypes.CDLL:
    lib = library(variant)
    if lib is None:
        raise RuntimeError(f"the native kernels ({variant}) could not be built: see the log")
    return lib


def _threads(numel: int, threads: int | None) -> int:
    """A thread per 256k elements at most (below, starting one costs more than it saves), at most torch's count."""
    return threads if threads is not None else max(1, min(torch.get_num_threads(), numel >> 18))


def int4_reduce_quantize(chunks: torch.Tensor, scales: torch.Tensor, group_size: int, *, threads: int | None = None,
                         variant: str = "native") -> tuple[torch.Tensor, torch.Tensor]:
    """``dequantize_reduce_quantize`` for INT4 on CPU: ``chunks`` [k, bytes] uint8 and ``scales`` [k, groups] fp32,
    each row contiguous, the rows at any stride (the caller checks them); returns (codes [bytes], scales [groups])."""
    lib = _lib(variant)
    k, nbytes = chunks.shape
    groups = scales.shape[1]
    if k > MAX_K:
        raise ValueError(f"the native INT4 reduction takes at most {MAX_K} chunks, got {k}")
    codes = torch.empty(nbytes, dtype=torch.uint8)
    out_scales = torch.empty(groups, dtype=torch.float32)
    if groups:
        rc = lib.mx_int4_reduce_quantize(chunks.data_ptr(), chunks.stride(0), scales.data_ptr(), scales.stride(0),
                                         k, groups, group_size // 2, codes.data_ptr(), out_scales.data_ptr(),
                                         _threads(groups * group_size, threads))
        if rc:
            raise MemoryError(f"the native INT4 reduction failed (status {rc})")
    return codes, out_scales


def quantize_into(x: torch.Tensor, bits: int, group_size: int, codes: torch.Tensor, scales: torch.Tensor, *,
                  threads: int | None = None, variant: str = "native") -> None:
    """Symmetric quantization of the contiguous fp32 ``x`` zero-padded to ``scales.numel()`` groups into the
    contiguous ``codes`` [groups * group_size * bits / 8] and ``scales`` [groups] (the caller sizes and checks them)."""
    groups = scales.numel()
    if groups:
        _lib(variant).mx_quantize(x.data_ptr(), x.numel(), groups, group_size, bits, codes.data_ptr(),
                                  scales.data_ptr(), _threads(groups * group_size, threads))


def dequantize_reduce(chunks: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int,
                      factor: float = 1.0, *, threads: int | None = None, variant: str = "native",
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 sum of the first ``numel`` elements of the k >= 1 chunks (``chunks`` [k, bytes] and ``scales``
    [k, groups], rows contiguous at any row stride, as ``reference.check_chunks`` checks them; k = 1 is the
    dequantization) times ``fl32(factor)``, into ``out`` (contiguous fp32, ``numel`` elements, checked by the caller)
    when given."""
    out = torch.empty(numel, dtype=torch.float32) if out is None else out
    if numel:
        _lib(variant).mx_dequantize_reduce(chunks.data_ptr(), chunks.stride(0), scales.data_ptr(), scales.stride(0),
                                           chunks.shape[0], numel, group_size, bits, factor, out.data_ptr(),
                                           _threads(numel, threads))
    return out


def dequantize_minmax(q: torch.Tensor, scale: torch.Tensor, lb: torch.Tensor, chunk_size: int, numel: int, *,
                      threads: int | None = None, variant: str = "native") -> torch.Tensor:
    """ByteGrad's fp32 ``(q + lb) / scale`` of the first ``numel`` codes, with each chunk's contiguous fp32
    ``scale`` and ``lb``: the decode-and-average of one row, times 1."""
    return dequantize_minmax_reduce(q.view(1, -1), scale.view(1, -1), lb.view(1, -1), chunk_size, numel, 1.0,
                                    threads=threads, variant=variant)


def dequantize_minmax_reduce(q: torch.Tensor, scale: torch.Tensor, lb: torch.Tensor, chunk_size: int, numel: int,
                             factor: float, *, threads: int | None = None, variant: str = "native",
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """ByteGrad's fp32 decode-and-average of ``k`` rows: ``q`` [k, >= numel] (rows contiguous at any row stride, as
    ``reference.check_minmax_rows`` checks them), each row's chunk ``scale`` and ``lb`` the rows of contiguous
    [k, chunks] fp32 tensors; the row-order sum times ``fl32(factor)``, into ``out`` (contiguous fp32, ``numel``
    elements, checked by the caller) when given."""
    out = torch.empty(numel, dtype=torch.float32) if out is None else out
    if numel:
        _lib(variant).mx_dequantize_minmax_reduce(q.data_ptr(), q.stride(0), scale.data_ptr(), lb.data_ptr(),
                                                  scale.stride(0), q.shape[0], numel, chunk_size, factor,
                                                  out.data_ptr(), _threads(numel, threads))
    return out
