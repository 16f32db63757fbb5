"""Tokenizers for pretrain_gpt and preprocess_data, behind megatron-core's ``MegatronTokenizerBase``.

megatron-core's GPTDataset only needs ``eod``, ``vocab_size`` (and optionally ``pad``) from the tokenizer; the
tokenizers here provide exactly that around the Hugging Face ``tokenizers`` library, so nothing is downloaded:
a byte-level BPE is either trained locally (:func:`train_bpe`) or read from GPT-2 style vocab/merges files.

Tokenizer types use Megatron-LM's ``--tokenizer-type`` names:
``GPT2BPETokenizer`` (``--vocab-file`` + ``--merge-file``), ``HuggingFaceTokenizer`` (``--tokenizer-model``
pointing at a ``tokenizer.json``, e.g. the one :func:`train_bpe` writes) and ``NullTokenizer``
(``--vocab-size V``: ids are space-separated integers below V, EOD is V; used with ``--mock-data``).
``--vocab-size`` is read by NullTokenizer only, as in Megatron-LM.
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator, List, Optional, Sequence

import numpy

from megatron.core.tokenizers import MegatronTokenizerBase

EOD_TOKEN = "<|endoftext|>"
# End-of-sequence tokens of common tokenizer families (GPT-2, Llama 1/2 and Mistral, Llama 3, Gemma), tried in order
# when a tokenizer.json comes without a tokenizer_config.json naming its eos_token.
EOS_CANDIDATES = (EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>")
TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")


class _Base(MegatronTokenizerBase):
    def __init__(self, path: str) -> None:
        super().__init__(path, {})
        # megatron-core hashes this into its dataset cache names (MegatronDataset.unique_description).
        self.unique_identifiers = {"class": type(self).__name__, "path": os.path.abspath(path)}

    def apply_chat_template(self, *args, **kwargs):  # noqa: D401 - not a chat tokenizer
        raise NotImplementedError("pretrain_gpt tokenizers have no chat template")

    @property
    def eos(self) -> int:
        return self.eod


class ByteLevelBPE(_Base):
    """A tokenizer of the ``tokenizers`` library (a byte-level BPE, GPT-2 style, or any ``tokenizer.json``), with
    ``eod_token`` (default ``<|endoftext|>``) as the end of a document.

    Truncation and padding saved in a ``tokenizer.json`` are switched off (on ``hf_tokenizer`` itself): documents are
    tokenized whole and unpadded, as Megatron-LM's HuggingFaceTokenizer gets them from transformers, not cut at the
    file's ``max_length`` nor padded with pad ids inside the data."""

    def __init__(self, hf_tokenizer, path: str, eod_token: str = EOD_TOKEN) -> None:
        super().__init__(path)
        hf_tokenizer.no_truncation()
        hf_tokenizer.no_padding()
        self._tok = hf_tokenizer
        eod = self._tok.token_to_id(eod_token)
        if eod is None:
            raise ValueError(f"tokenizer {path!r} has no {eod_token} token (needed as end-of-document)")
        self._eod = int(eod)

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    @property
    def vocab(self) -> dict:
        return self._tok.get_vocab()

    @property
    def inv_vocab(self) -> dict:
        return {v: k for k, v in self._tok.get_vocab().items()}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def eod(self) -> int:
        return self._eod


class NullTokenizer(_Base):
    """Ids in, ids out, exactly as Megatron-LM's NullTokenizer (megatron-core's ``null`` tokenizer library).

    ``--vocab-size V`` names the ids ``0 .. V-1``; the EOD id is ``V`` itself, so the vocabulary is ``V + 1``
    (megatron-core's rule, which this class delegates to).
    """

    def __init__(self, vocab_size: int) -> None:
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as CoreNullTokenizer

        super().__init__("null")
        if vocab_size is None or vocab_size < 1:
            raise ValueError(f"--tokenizer-type NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        self._core = CoreNullTokenizer(vocab_size)

    def tokenize(self, text: str) -> List[int]:
        return self._core.text_to_ids(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._core.ids_to_text([int(i) for i in ids])

    @property
    def vocab(self) -> dict:
        return {}

    @property
    def vocab_size(self) -> int:
        return self._core.vocab_size

    @property
    def eod(self) -> int:
        return self._core.eod


def train_bpe(texts: Iterator[str], vocab_size: int, save_path: str) -> ByteLevelBPE:
    """Train a byte-level BPE on ``texts`` locally and save it as a ``tokenizer.json`` at ``save_path``."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD_TOKEN],
                            show_progress=False)
    os.makedirs(os.path.dirname(os.path.abspath(save_path)), exist_ok=True)
    tmp = save_path + ".tmp"
    tok.save(tmp)
    os.replace(tmp, save_path)
    return load_tokenizer("HuggingFaceTokenizer", tokenizer_model=save_path)


def load_tokenizer(tokenizer_type: str, *, tokenizer_model: Optional[str] = None, vocab_file: Optional[str] = None,
                   merge_file: Optional[str] = None, vocab_size: Optional[int] = None) -> MegatronTokenizerBase:
    """Build a tokenizer from Megatron-LM's tokenizer flags; errors name the missing flag or file."""
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        if not vocab_file or not merge_file:
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
        for flag, p in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{flag} {p}: no such file")
        from tokenizers import ByteLevelBPETokenizer

        bpe = ByteLevelBPETokenizer.from_file(vocab_file, merge_file)
        if bpe.token_to_id(EOD_TOKEN) is None:
            bpe.add_special_tokens([EOD_TOKEN])
        return ByteLevelBPE(bpe._tokenizer, vocab_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json)")
        path = tokenizer_model
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--tokenizer-model {tokenizer_model}: no tokenizer.json there "
                                    "(this build reads local files only; nothing is downloaded)")
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(path)
        except Exception as e:   # the tokenizers library raises a bare Exception for a malformed file
            raise ValueError(f"--tokenizer-model {tokenizer_model}: {path} is not a tokenizer.json the tokenizers "
                             f"library can read ({e})") from None
        return ByteLevelBPE(tok, path, _eos_token(tok, path, tokenizer_model))
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of {TOKENIZER_TYPES}")


def _eos_token(tok, path: str, flag_value: str) -> str:
    """The end-of-sequence token, as Megatron-LM's HuggingFaceTokenizer takes ``eos_token``: the one the
    ``tokenizer_config.json`` beside ``path`` names, else the first of :data:`EOS_CANDIDATES` in the vocabulary."""
    import json

    config = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    if os.path.isfile(config):
        try:
            with open(config) as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--tokenizer-model {flag_value}: {config} is not valid JSON ({e.msg})") from None
        eos = cfg.get("eos_token") if isinstance(cfg, dict) else None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and tok.token_to_id(eos) is not None:
            return eos
    for token in EOS_CANDIDATES:
        if tok.token_to_id(token) is not None:
            return token
    raise ValueError(f"--tokenizer-model {flag_value}: no end-of-sequence token found (no tokenizer_config.json "
                     f"eos_token beside it, and none of {', '.join(EOS_CANDIDATES)} in its vocabulary); documents "
                     "need one to be separated")


def optimal_index_dtype(vocab_size: int) -> type:
    """uint16 when every id fits (half the disk and page cache), else int32 (megatron-core's rule)."""
    return numpy.uint16 if vocab_size < 65500 else numpy.int32
