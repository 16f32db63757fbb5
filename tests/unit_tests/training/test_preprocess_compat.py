"""tools/preprocess_data.py writes what Megatron-LM's tools/preprocess_data.py writes for the same input.

Megatron-LM's ``Encoder.encode``: a JSON value that is a list is a list of sentences, each tokenized on its own and
kept as one sequence when non-empty; ``--append-eod`` ends the last sentence of a non-empty document only; every
``--input`` is JSON lines. Its HuggingFaceTokenizer calls transformers without truncation or padding. The expected
arrays below are written out by hand from those rules, for a word-level tokenizer whose ids are easy to read.
"""
from __future__ import annotations

import json
import os
import sys

import numpy
import pytest

from .conftest import REPO

# id 0 <unk>, 1 the end of document, then one id per word
WORDS = ["<unk>", "<|endoftext|>", "a", "b", "c", "d", "e", "f", "g", "h"]


def _preprocess():
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import preprocess_data
    return preprocess_data


def _word_tokenizer(directory, truncate_and_pad: bool = False) -> str:
    """A whitespace word-level tokenizer.json; ``truncate_and_pad`` saves truncation (3) and padding in the file, as
    a tokenizer exported with ``max_length`` / a pad setting carries them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if truncate_and_pad:
        tok.enable_truncation(max_length=3)
        tok.enable_padding(pad_id=0, pad_token="<unk>")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(str(directory), "tokenizer.json")
    tok.save(path)
    return path


def _write_jsonl(path, values, key="text") -> str:
    with open(path, "w") as f:
        for v in values:
            f.write(json.dumps({key: v}) + "\n")
    return str(path)


def _run(tmp_path, inputs, tok_json, *extra, name="out"):
    rc = _preprocess().main(["--input", *inputs, "--output-prefix", str(tmp_path / name), "--tokenizer-type",
                             "HuggingFaceTokenizer", "--tokenizer-model", tok_json, *extra])
    return rc, str(tmp_path / f"{name}_text_document")


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return (ds.sequence_lengths.tolist(), ds.document_indices.tolist(),
            [ds[i].tolist() for i in range(len(ds))])


def test_tokenizer_file_truncation_and_padding_are_switched_off(tmp_path):
    """A tokenizer.json saved with truncation and padding gives the ids of the same tokenizer without them, one text
    or a batch of different lengths (no document cut at max_length, no pad id inside the data)."""
    from megatron_ext.training.tokenizer import load_tokenizer

    plain = load_tokenizer("HuggingFaceTokenizer", tokenizer_model=_word_tokenizer(tmp_path / "plain"))
    saved = load_tokenizer("HuggingFaceTokenizer", tokenizer_model=_word_tokenizer(tmp_path / "trunc", True))
    texts = ["a b c d e f", "g", "h a"]
    assert plain.tokenize(texts[0]) == [2, 3, 4, 5, 6, 7]
    assert saved.tokenize(texts[0]) == plain.tokenize(texts[0])
    assert saved.tokenize_batch(texts) == plain.tokenize_batch(texts) == [[2, 3, 4, 5, 6, 7], [8], [9, 2]]


def test_list_values_are_sentences_and_empty_documents_have_no_tokens(tmp_path):
    """One sequence per non-empty sentence; EOD on a non-empty document's last sentence; an empty document is
    a document of no sequences (megatron-core's add_document(ids=[], lengths=[]), as Megatron-LM writes it)."""
    tok_json = _word_tokenizer(tmp_path / "tok")
    jsonl = _write_jsonl(tmp_path / "in.jsonl", [["a b", "c"], "", "d", ["", "e f"], [], [""]])
    rc, prefix = _run(tmp_path, [jsonl], tok_json, "--append-eod")
    assert rc == 0
    assert _read(prefix) == ([2, 2, 2, 3], [0, 2, 2, 3, 4, 4, 4], [[2, 3], [4, 1], [5, 1], [6, 7, 1]])
    rc, prefix = _run(tmp_path, [jsonl], tok_json, name="noeod")
    assert rc == 0
    assert _read(prefix) == ([2, 1, 1, 2], [0, 2, 2, 3, 4, 4, 4], [[2, 3], [4], [5], [6, 7]])


def test_a_value_that_is_not_text_is_an_error_naming_the_line(tmp_path, capsys):
    tok_json = _word_tokenizer(tmp_path / "tok")
    for bad in ({"text": 3}, {"text": ["a", 1]}, ["a"]):
        jsonl = tmp_path / "bad.jsonl"
        jsonl.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps(bad) + "\n")
        rc, prefix = _run(tmp_path, [str(jsonl)], tok_json)
        err = capsys.readouterr().err
        assert rc == 2 and f"{jsonl}:2" in err, err
        assert not os.path.exists(prefix + ".bin")


def test_json_lines_are_found_by_content_whatever_the_file_name(tmp_path):
    """A Megatron-LM script's loose JSON named *.txt or *.data is JSON lines, not one document of JSON syntax."""
    tok_json = _word_tokenizer(tmp_path / "tok")
    values = ["a b", "c"]
    ref = _write_jsonl(tmp_path / "in.jsonl", values)
    for name in ("in.txt", "in.data"):
        other = _write_jsonl(tmp_path / name, values)
        with open(other) as f:   # a blank first line is skipped when deciding
            text = f.read()
        with open(other, "w") as f:
            f.write("\n" + text)
        rc, prefix = _run(tmp_path, [other], tok_json, "--append-eod", name=name.replace(".", "_"))
        assert rc == 0
        assert _read(prefix) == _read(_run(tmp_path, [ref], tok_json, "--append-eod")[1]) \
            == ([3, 2], [0, 1, 2], [[2, 3, 1], [4, 1]])


def test_text_files_stay_one_document_each(tmp_path):
    """A file whose first non-empty line is not a JSON object (prose, or JSON that is not an object) is raw text."""
    tok_json = _word_tokenizer(tmp_path / "tok")
    prose, scalar = tmp_path / "prose.txt", tmp_path / "scalar.txt"
    prose.write_text("a b\n{\"text\": \"c\"}\n")
    scalar.write_text("\"d\"\ne\n")
    rc, prefix = _run(tmp_path, [str(prose), str(scalar)], tok_json, "--append-eod")
    assert rc == 0
    lengths, docs, seqs = _read(prefix)
    assert len(lengths) == 2 and docs == [0, 1, 2]   # two documents, one per file
    assert seqs[0][:2] == [2, 3] and seqs[0][-1] == seqs[1][-1] == 1


def test_a_json_lines_file_with_a_bad_line_is_an_error_naming_file_and_line(tmp_path, capsys):
    """Found by content (first line a JSON object) or by name, a line that is not JSON stops the tool with
    file:line rather than writing the rest, or the whole file as text."""
    tok_json = _word_tokenizer(tmp_path / "tok")
    for name in ("loose.txt", "named.jsonl"):
        path = tmp_path / name
        path.write_text(json.dumps({"text": "a"}) + "\n\n" + "{not json\n")
        rc, prefix = _run(tmp_path, [str(path)], tok_json)
        err = capsys.readouterr().err
        assert rc == 2 and f"{path}:3" in err and "JSON" in err, err
        assert not os.path.exists(prefix + ".bin")
        assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]   # no half-written files left
