"""Shared fixtures for pretrain_gpt tests: a small real-text indexed dataset made by tools/preprocess_data.py."""
from __future__ import annotations

import os
import sys
import sysconfig

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# A few standard-library modules: real English prose (docstrings, comments) and code, present on every machine.
CORPUS_FILES = ("argparse.py", "textwrap.py", "difflib.py", "shlex.py", "fractions.py", "string.py",
                "heapq.py", "bisect.py", "calendar.py", "csv.py", "glob.py", "fnmatch.py")


def _tiny_model_flags() -> list:
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "2", "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--hidden-dropout", "0.0",
            "--attention-dropout", "0.0", "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234",
            "--eval-iters", "0", "--log-interval", "1", "--ddp-bucket-size", "20000",
            "--overlap-grad-reduce", "--overlap-param-gather", "--use-distributed-optimizer"]


@pytest.fixture(scope="session")
def text_dataset(tmp_path_factory):
    """(data_prefix, tokenizer_json): a JSONL of stdlib sources preprocessed with a locally trained 512-token BPE."""
    import json

    sys.path.insert(0, os.path.join(REPO, "tools"))
    import preprocess_data

    root = sysconfig.get_paths()["stdlib"]
    out = tmp_path_factory.mktemp("data")
    jsonl = out / "corpus.jsonl"
    with open(jsonl, "w") as f:
        for name in CORPUS_FILES:
            with open(os.path.join(root, name), encoding="utf-8") as src:
                text = src.read()
            # several documents per file, so train/valid splits both get some
            for i in range(0, len(text), 8000):
                f.write(json.dumps({"text": text[i:i + 8000]}) + "\n")
    prefix = str(out / "stdlib")
    assert preprocess_data.main(["--input", str(jsonl), "--output-prefix", prefix, "--train-tokenizer-vocab-size",
                                 "512", "--append-eod"]) == 0
    return prefix + "_text_document", prefix + "_tokenizer.json"


@pytest.fixture
def tiny_model_flags():
    return _tiny_model_flags()
