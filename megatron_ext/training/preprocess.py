"""Text / JSONL -> megatron-core indexed dataset (``.bin`` + ``.idx``), the format GPTDataset reads.

Output naming follows Megatron-LM's ``tools/preprocess_data.py``: ``{output_prefix}_{json_key}_document.bin/.idx``,
and ``--data-path`` takes the prefix without the extension. Each JSONL line (``json_keys``) or each plain text
file is one document; ``append_eod`` ends each document with the tokenizer's EOD so GPTDataset's samples, which
cross document borders, see the boundary.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Iterator, List, Sequence

import numpy

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from .tokenizer import optimal_index_dtype


def iter_documents(inputs: Sequence[str], json_keys: Sequence[str] = ("text",), key: str = "text") -> Iterator[str]:
    """Yield the documents of ``inputs`` for one ``key``: JSONL lines (``*.jsonl``/``*.json``) or whole text files."""
    for path in inputs:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--input {path}: no such file")
        if path.endswith((".jsonl", ".json")):
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                    if key not in obj:
                        raise KeyError(f"{path}:{lineno}: no key {key!r} (--json-keys {' '.join(json_keys)})")
                    yield str(obj[key])
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def build_indexed_dataset(documents: Iterable[str], tokenizer, prefix: str, append_eod: bool = True,
                          batch: int = 64) -> dict:
    """Tokenize ``documents`` into ``{prefix}.bin/.idx`` atomically (temp names, then rename); returns stats."""
    dtype = optimal_index_dtype(tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
    tmp_prefix = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp_prefix + ".bin", dtype=dtype)
    n_docs = n_tokens = 0
    encode = getattr(tokenizer, "tokenize_batch", None) or (lambda ts: [tokenizer.tokenize(t) for t in ts])

    def flush(buf: List[str]) -> None:
        nonlocal n_docs, n_tokens
        for ids in encode(buf):
            if append_eod:
                ids = list(ids) + [tokenizer.eod]
            if not ids:
                continue
            builder.add_document(numpy.asarray(ids, dtype=numpy.int64), [len(ids)])
            n_docs += 1
            n_tokens += len(ids)

    buf: List[str] = []
    for doc in documents:
        buf.append(doc)
        if len(buf) >= batch:
            flush(buf)
            buf = []
    if buf:
        flush(buf)
    if n_docs == 0:
        builder.finalize(tmp_prefix + ".idx")
        for ext in (".bin", ".idx"):
            os.unlink(tmp_prefix + ext)
        raise ValueError("no documents to write (empty input?)")
    builder.finalize(tmp_prefix + ".idx")
    os.replace(tmp_prefix + ".bin", prefix + ".bin")
    os.replace(tmp_prefix + ".idx", prefix + ".idx")
    return {"prefix": prefix, "documents": n_docs, "tokens": n_tokens, "dtype": numpy.dtype(dtype).name}
