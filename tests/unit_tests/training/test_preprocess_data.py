"""tools/preprocess_data.py writes megatron-core indexed datasets that GPTDataset reads (no downloads)."""
from __future__ import annotations

import json
import os
import sys

import numpy
import pytest

from .conftest import REPO


def _preprocess():
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import preprocess_data
    return preprocess_data


def test_indexed_dataset_round_trip(text_dataset):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.training.tokenizer import load_tokenizer

    prefix, tok_json = text_dataset
    tok = load_tokenizer("HuggingFaceTokenizer", tokenizer_model=tok_json)
    ds = IndexedDataset(prefix)
    assert len(ds) > 20
    doc = ds[0]
    assert doc.dtype == numpy.uint16 and doc[-1] == tok.eod  # --append-eod
    assert "import" in tok.detokenize(doc[:-1].tolist())     # real text back out


def test_gpt2_vocab_and_merges_files(tmp_path):
    """GPT-2 style vocab.json/merges.txt (here from a locally trained BPE) drive --tokenizer-type GPT2BPETokenizer."""
    from tokenizers import ByteLevelBPETokenizer

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = ["The quick brown fox jumps over the lazy dog. " * 20, "Pack my box with five dozen liquor jugs. " * 20]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(tmp_path))
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    rc = _preprocess().main(["--input", str(jsonl), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
                             "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "vocab.json"), "--merge-file",
                             str(tmp_path / "merges.txt"), "--append-eod"])
    assert rc == 0
    assert len(IndexedDataset(str(tmp_path / "out_text_document"))) == 2


def test_flag_errors(tmp_path, capsys):
    pre = _preprocess()
    with pytest.raises(SystemExit):
        pre.main(["--input", "x.jsonl", "--output-prefix", str(tmp_path / "o")])
    assert "--tokenizer-type" in capsys.readouterr().err
    rc = pre.main(["--input", "x.jsonl", "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
                   "GPT2BPETokenizer"])
    assert rc == 2 and "--vocab-file" in capsys.readouterr().err
    # Megatron-LM's sentence splitting needs NLTK's punkt data: refused by name, with the way that works here
    for extra in (["--split-sentences"], ["--keep-newlines"], ["--lang", "english"], ["--partitions", "4"]):
        with pytest.raises(SystemExit):
            pre.main(["--input", "x.jsonl", "--output-prefix", str(tmp_path / "o"), "--train-tokenizer-vocab-size",
                      "300"] + extra)
        err = capsys.readouterr().err
        assert extra[0] in err and ("JSON list of sentences" in err or "only 1" in err), err
