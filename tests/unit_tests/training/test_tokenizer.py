"""Tokenizers follow Megatron-LM: NullTokenizer as megatron-core's null tokenizer (EOD = --vocab-size), a Hugging Face
tokenizer.json with its own end-of-sequence token."""
from __future__ import annotations

import os

from megatron_ext.training.tokenizer import load_tokenizer


def test_null_tokenizer_matches_megatron_core():
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as CoreNullTokenizer

    ours, core = load_tokenizer("NullTokenizer", vocab_size=100), CoreNullTokenizer(100)
    assert (ours.vocab_size, ours.eod) == (core.vocab_size, core.eod) == (101, 100)
    assert ours.tokenize("3 1 4 1 5") == core.text_to_ids("3 1 4 1 5") == [3, 1, 4, 1, 5]
    assert ours.detokenize([2, 7]) == "2 7"


def test_hugging_face_tokenizer_takes_its_own_end_of_sequence_token(tmp_path):
    """Llama/Mistral-style tokenizers end documents with </s>, not <|endoftext|>: the EOS is the one a
    tokenizer_config.json beside the file names (as Megatron-LM's eos_token), else the first known one present."""
    import json

    from tokenizers import Tokenizer, models

    from megatron_ext.training.tokenizer import load_tokenizer

    def word_level(directory, tokens):
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "tokenizer.json")
        Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0])).save(path)
        return path

    llama = word_level(tmp_path / "llama", ["<unk>", "<s>", "</s>", "a"])
    assert load_tokenizer("HuggingFaceTokenizer", tokenizer_model=llama).eod == 2
    both = word_level(tmp_path / "both", ["<unk>", "<|endoftext|>", "</s>", "<|im_end|>"])
    assert load_tokenizer("HuggingFaceTokenizer", tokenizer_model=both).eod == 1   # the first candidate
    with open(tmp_path / "both" / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": {"content": "<|im_end|>"}}, f)
    assert load_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "both")).eod == 3
