"""NullTokenizer follows Megatron-LM (megatron-core's null tokenizer): ids below --vocab-size, EOD = --vocab-size."""
from __future__ import annotations

from megatron_ext.training.tokenizer import load_tokenizer


def test_null_tokenizer_matches_megatron_core():
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as CoreNullTokenizer

    ours, core = load_tokenizer("NullTokenizer", vocab_size=100), CoreNullTokenizer(100)
    assert (ours.vocab_size, ours.eod) == (core.vocab_size, core.eod) == (101, 100)
    assert ours.tokenize("3 1 4 1 5") == core.text_to_ids("3 1 4 1 5") == [3, 1, 4, 1, 5]
    assert ours.detokenize([2, 7]) == "2 7"
