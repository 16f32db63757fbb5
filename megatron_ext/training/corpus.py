"""The embedded default corpus: real text that is already on every machine, so the demo needs no download.

Without ``--data-path``, pretrain_gpt trains on the Python standard library's own ``.py`` sources (code, comments
and docstrings: several MB of real, human-written text) found under ``sysconfig``'s ``stdlib`` path. The corpus is
built once: a byte-level BPE is trained on it locally and the documents are written as a megatron-core indexed
dataset, in a cache directory keyed by the Python version and the corpus settings. The build is atomic (temporary
directory, then rename), so concurrent or interrupted builds never leave a half-written cache behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from typing import Dict, List, Optional, Tuple

from .preprocess import build_indexed_dataset
from .tokenizer import train_bpe

CORPUS_VERSION = 1
DEFAULT_VOCAB_SIZE = 4096   # the BPE's target size; pretrain_gpt --auto-plan plans with it before the corpus exists


def default_cache_dir() -> str:
    return os.environ.get("MEGATRON_EXT_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "megatron_ext"))


def stdlib_sources(max_bytes: int) -> List[str]:
    """Sorted stdlib ``.py`` files (tests and site-packages excluded), up to ``max_bytes`` in total."""
    root = sysconfig.get_paths()["stdlib"]
    files: List[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        parts = rel.split(os.sep)
        if any(p in ("site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__") for p in parts):
            dirnames[:] = []
            continue
        dirnames.sort()
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    out, total = [], 0
    for f in files:
        size = os.path.getsize(f)
        if size == 0:
            continue
        if total + size > max_bytes:
            break
        out.append(f)
        total += size
    if not out:
        raise RuntimeError(f"no Python standard library sources found under {root} for the default corpus; "
                           "pass --data-path")
    return out


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def build_default_corpus(cache_dir: Optional[str] = None, vocab_size: int = DEFAULT_VOCAB_SIZE,
                         max_bytes: int = 6_000_000) -> Tuple[str, str]:
    """Return ``(data_prefix, tokenizer_json)`` of the cached default corpus, building it on first use.

    Call it on one process (pretrain_gpt does it on global rank 0 before a barrier).
    """
    cache_dir = cache_dir or default_cache_dir()
    key = json.dumps({"v": CORPUS_VERSION, "py": sys.version.split()[0], "vocab": vocab_size, "max": max_bytes,
                      "root": sysconfig.get_paths()["stdlib"]}, sort_keys=True)
    name = "stdlib-corpus-" + hashlib.sha1(key.encode()).hexdigest()[:12]
    final = os.path.join(cache_dir, name)
    prefix, tok_path = os.path.join(final, "text_document"), os.path.join(final, "tokenizer.json")
    if os.path.isfile(os.path.join(final, "DONE")):
        return prefix, tok_path
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=name + ".tmp", dir=cache_dir)
    try:
        files = stdlib_sources(max_bytes)
        tok = train_bpe((_read(f) for f in files), vocab_size, os.path.join(tmp, "tokenizer.json"))
        stats = build_indexed_dataset((_read(f) for f in files), tok, os.path.join(tmp, "text_document"))
        info: Dict = {"files": len(files), "root": sysconfig.get_paths()["stdlib"], **stats, "vocab": tok.vocab_size}
        info["prefix"] = prefix
        with open(os.path.join(tmp, "DONE"), "w") as f:
            json.dump(info, f, indent=1)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: use theirs
            if not os.path.isfile(os.path.join(final, "DONE")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return prefix, tok_path
