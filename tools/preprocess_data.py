#!/usr/bin/env python
"""Turn text or JSONL into megatron-core indexed datasets (.bin/.idx) for ``pretrain_gpt --data-path``.

Megatron-LM's flag names. A tokenizer either comes from files (``--tokenizer-type GPT2BPETokenizer --vocab-file
--merge-file``, or ``HuggingFaceTokenizer --tokenizer-model tokenizer.json``) or is trained here on the input
itself (``--train-tokenizer-vocab-size N``, a byte-level BPE written to ``{output_prefix}_tokenizer.json``). No
download happens. Example::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my \\
        --train-tokenizer-vocab-size 8192 --append-eod
    # -> data/my_text_document.{bin,idx} and data/my_tokenizer.json; then
    # pretrain_gpt --data-path data/my_text_document --tokenizer-type HuggingFaceTokenizer \\
    #     --tokenizer-model data/my_tokenizer.json
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

from megatron_ext.training.preprocess import build_indexed_dataset, iter_documents, output_prefix_for
from megatron_ext.training.tokenizer import TOKENIZER_TYPES, load_tokenizer, train_bpe


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True, help="JSON lines files (one document per line: *.jsonl, "
                   "*.json, or any file whose first non-empty line is a JSON object) or text files (one document "
                   "per file)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys to extract (one dataset each); a "
                   "value is a string, or a list of strings (sentences, one sequence each, as Megatron-LM)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    g.add_argument("--tokenizer-model", default=None, help="tokenizer.json for HuggingFaceTokenizer")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer only: ids 0..V-1, EOD is V (Megatron-LM's rule)")
    g.add_argument("--train-tokenizer-vocab-size", type=int, default=None,
                   help="train a byte-level BPE of this size on the input (saved as {output_prefix}_tokenizer.json)")
    g.add_argument("--append-eod", action="store_true",
                   help="end each document with the tokenizer's end-of-document token (<|endoftext|> for the "
                   "tokenizers this tool trains and GPT-2 files; a tokenizer.json's own EOS, e.g. </s>)")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True)
    g.add_argument("--workers", type=int, default=1, help="accepted for Megatron-LM compatibility (tokenization "
                   "uses the tokenizers library's own threads)")
    g.add_argument("--log-interval", type=int, default=1000, help="accepted for Megatron-LM compatibility")
    g.add_argument("--partitions", type=int, default=1, help="accepted for Megatron-LM compatibility (1 only)")
    for flag in ("--split-sentences", "--keep-newlines"):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lang", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for flag, given in (("--split-sentences", args.split_sentences), ("--keep-newlines", args.keep_newlines),
                        ("--lang", args.lang is not None)):
        if given:
            p.error(f"{flag} is not supported (Megatron-LM splits with NLTK's punkt data, which this tool does not "
                    "download): give each document as a JSON list of sentences, one sequence each")
    if args.partitions != 1:
        p.error(f"--partitions {args.partitions}: only 1 is supported (tokenization is already multi-threaded)")
    if args.train_tokenizer_vocab_size is not None and args.tokenizer_type is not None:
        p.error("--train-tokenizer-vocab-size conflicts with --tokenizer-type (train one, or load one)")
    if args.train_tokenizer_vocab_size is None and args.tokenizer_type is None:
        p.error("give --tokenizer-type (with its files) or --train-tokenizer-vocab-size")
    if args.vocab_size is not None and args.tokenizer_type != "NullTokenizer":
        print(f"WARNING: --vocab-size {args.vocab_size} is ignored: only --tokenizer-type NullTokenizer reads it",
              file=sys.stderr)
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = get_args(argv)
    try:
        return _run(args)
    except (ValueError, KeyError, FileNotFoundError) as e:   # bad input or tokenizer: the message names it
        print(f"preprocess_data.py: error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    t0 = time.time()
    if args.train_tokenizer_vocab_size is not None:
        path = args.output_prefix + "_tokenizer.json"
        tok = train_bpe(iter_documents(args.input, args.json_keys, args.json_keys[0]),
                        args.train_tokenizer_vocab_size, path)
        print(f"trained byte-level BPE (vocab {tok.vocab_size}) -> {path}")
    else:
        tok = load_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                             vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size)
    for key in args.json_keys:
        stats = build_indexed_dataset(iter_documents(args.input, args.json_keys, key), tok,
                                      output_prefix_for(args.output_prefix, key), append_eod=args.append_eod)
        print(f"wrote {stats['prefix']}.bin/.idx: {stats['documents']} documents, {stats['sequences']} sequences, "
              f"{stats['tokens']} tokens ({stats['dtype']})")
    print(f"done in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
