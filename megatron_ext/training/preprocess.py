"""Text / JSONL -> megatron-core indexed dataset (``.bin`` + ``.idx``), the format GPTDataset reads.

Output naming follows Megatron-LM's ``tools/preprocess_data.py``: ``{output_prefix}_{json_key}_document.bin/.idx``,
and ``--data-path`` takes the prefix without the extension. Each JSON line (``json_keys``) or each plain text
file is one document; ``append_eod`` ends each non-empty document with the tokenizer's EOD so GPTDataset's samples,
which cross document borders, see the boundary.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Iterator, List, Sequence, Union

import numpy

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from .tokenizer import optimal_index_dtype


# A document as Megatron-LM's Encoder.encode takes a JSON value: a string, or a list of strings (sentences).
Document = Union[str, List[str]]


def is_json_lines(path: str) -> bool:
    """``*.jsonl``/``*.json`` by name, or any file whose first non-empty line is a JSON object.

    Megatron-LM reads every ``--input`` as JSON lines whatever its name, so loose JSON named ``*.txt`` must not be
    trained on as JSON syntax; a real text file (first line prose, or JSON that is not an object) stays raw text.
    """
    if path.endswith((".jsonl", ".json")):
        return True
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    return isinstance(json.loads(line), dict)
                except ValueError:
                    return False
    return False


def iter_documents(inputs: Sequence[str], json_keys: Sequence[str] = ("text",), key: str = "text"
                   ) -> Iterator[Document]:
    """Yield the documents of ``inputs`` for one ``key``: JSON lines' values (see :func:`is_json_lines`), or whole
    text files. Errors name the file and line."""
    for path in inputs:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--input {path}: no such file")
        if not is_json_lines(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()
            continue
        why = "" if path.endswith((".jsonl", ".json")) else " (read as JSON lines: its first line is a JSON object)"
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}){why}") from None
                if not isinstance(obj, dict):
                    raise ValueError(f"{path}:{lineno}: a JSON {type(obj).__name__}, not an object (--input takes "
                                     f"one JSON object per line){why}")
                if key not in obj:
                    raise KeyError(f"{path}:{lineno}: no key {key!r} (--json-keys {' '.join(json_keys)})")
                text = obj[key]
                if not (isinstance(text, str) or isinstance(text, list) and all(isinstance(t, str) for t in text)):
                    raise ValueError(f"{path}:{lineno}: {key!r} is not a string or a list of strings "
                                     f"(--json-keys {' '.join(json_keys)})")
                yield text


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def build_indexed_dataset(documents: Iterable[Document], tokenizer, prefix: str, append_eod: bool = True,
                          batch: int = 64) -> dict:
    """Tokenize ``documents`` into ``{prefix}.bin/.idx`` atomically (temp names, then rename); returns stats.

    As Megatron-LM's Encoder.encode: each sentence of a document (a list value) is tokenized alone and kept as one
    sequence when non-empty; EOD ends the last sentence of a non-empty document only, so an empty document is a
    document of no sequences and no tokens (GPTDataset samples sequences, so it never sees it).
    """
    dtype = optimal_index_dtype(tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
    tmp_prefix = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp_prefix + ".bin", dtype=dtype)
    n_docs = n_seqs = n_tokens = 0
    encode = getattr(tokenizer, "tokenize_batch", None) or (lambda ts: [tokenizer.tokenize(t) for t in ts])

    def flush(buf: List[Document]) -> None:
        nonlocal n_docs, n_seqs, n_tokens
        docs = [d if isinstance(d, list) else [d] for d in buf]
        ids = iter(encode([sentence for d in docs for sentence in d]))   # one batch for all sentences
        for d in docs:
            seqs = [list(s) for s in (next(ids) for _ in d)]
            seqs = [s for s in seqs if s]
            if seqs and append_eod:
                seqs[-1].append(tokenizer.eod)
            tokens = [t for s in seqs for t in s]
            builder.add_document(numpy.asarray(tokens, dtype=numpy.int64), [len(s) for s in seqs])
            n_docs += 1
            n_seqs += len(seqs)
            n_tokens += len(tokens)

    try:
        buf: List[Document] = []
        for doc in documents:
            buf.append(doc)
            if len(buf) >= batch:
                flush(buf)
                buf = []
        if buf:
            flush(buf)
        if n_tokens == 0:
            raise ValueError("no tokens to write (empty input?)")
        builder.finalize(tmp_prefix + ".idx")
    except BaseException:
        builder.data_file.close()
        for ext in (".bin", ".idx"):
            if os.path.exists(tmp_prefix + ext):
                os.unlink(tmp_prefix + ext)
        raise
    os.replace(tmp_prefix + ".bin", prefix + ".bin")
    os.replace(tmp_prefix + ".idx", prefix + ".idx")
    return {"prefix": prefix, "documents": n_docs, "sequences": n_seqs, "tokens": n_tokens,
            "dtype": numpy.dtype(dtype).name}
