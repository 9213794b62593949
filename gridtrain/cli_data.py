"""`gridtrain data prepare` and `gridtrain data stats`: a corpus into token shards, and what they hold."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gridtrain.argtypes import number
from gridtrain.errors import BadInput, MissingInput
from gridtrain.rundir import unwritable
from gridtrain.validate_data import tokenizer_vocab

DEFAULT_WORKERS = min(8, os.cpu_count() or 1)


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare token shards from text, and say what they hold")
    dsub = p.add_subparsers(dest="data_command", required=True)
    d = dsub.add_parser("prepare", help="tokenize text, parquet, JSON lines (.gz, .zst) or a saved dataset into shards")
    d.add_argument("source", nargs="?", help="default: the Python standard library's source")
    d.add_argument("--tokenizer", default="byte", help="'byte', 'bpe:N' or a tokenizer.json")
    d.add_argument("--out", help="output directory (default: the cache, as training uses it)")
    d.add_argument("--overwrite", action="store_true",
                   help="replace a dataset already prepared in --out (never other files there)")
    d.add_argument("--val-fraction", type=number(float, 0, 0.5, low_open=True), default=0.005)
    d.add_argument("--seed", type=number(int, 0), default=0)
    d.add_argument("--cache-dir", default="~/.cache/gridtrain")
    d.add_argument("--text-column", default="text", help="the column (parquet, Arrow) or field (JSON lines) of the text")
    d.add_argument("--workers", type=number(int, 1, 256), default=DEFAULT_WORKERS,
                   help=f"tokenizing processes (default {DEFAULT_WORKERS}; 1 tokenizes in this process)")
    d.add_argument("--shard-tokens", type=number(int, 1), default=2**26, help="tokens per shard file (default 2^26)")
    d.set_defaults(func=cmd_data_prepare)
    s = dsub.add_parser("stats", help="counts per source and document lengths of a prepared directory, with a histogram")
    s.add_argument("prepared_dir")
    s.add_argument("--png", help="where the histogram goes (default: PREPARED_DIR/lengths.png)")
    s.set_defaults(func=cmd_data_stats)


def check_prepare_args(args: argparse.Namespace) -> None:
    """Every refusal of `data prepare` before anything is written, in one line."""
    from gridtrain.data.corpus import source_problem

    bad = tokenizer_vocab(args.tokenizer, "--tokenizer")[1]
    if args.source:
        bad = source_problem(args.source, args.text_column) or bad
    cache_used = not args.out or args.tokenizer.startswith("bpe:")  # a trained BPE is cached
    for flag, path in (("--out", args.out), ("--cache-dir", args.cache_dir if cache_used else None)):
        why = path and unwritable(Path(path).expanduser())
        bad = bad or (why and f"{flag} {path}: {why}")
    if bad:
        raise BadInput(bad)


def cmd_data_prepare(args: argparse.Namespace, extra: list[str]) -> int:
    from gridtrain.data.corpus import default_corpus
    from gridtrain.data.shards import check_output, ensure_prepared, prepare
    from gridtrain.data.stats import summary_lines
    from gridtrain.data.tokenizer import build_tokenizer

    check_prepare_args(args)
    if args.out:
        check_output(Path(args.out), args.overwrite)
        tokenizer = build_tokenizer(args.tokenizer, args.source, Path(args.cache_dir).expanduser())
        out = prepare(args.source or default_corpus(), tokenizer, Path(args.out), args.val_fraction, args.seed,
                      shard_tokens=args.shard_tokens, overwrite=args.overwrite, column=args.text_column,
                      workers=args.workers)
    else:
        out = ensure_prepared(args.source, args.tokenizer, Path(args.cache_dir).expanduser(),
                              args.val_fraction, args.seed, column=args.text_column, workers=args.workers)
    print("\n".join(summary_lines(out)))
    print(f"prepared: {out}  (train with --data.corpus {out}; `gridtrain data stats {out}` prints this again)")
    return 0


def cmd_data_stats(args: argparse.Namespace, extra: list[str]) -> int:
    from gridtrain.data.shards import INDEX_FILE, LENGTHS_PNG
    from gridtrain.data.stats import histogram_png, summary_lines

    prepared = Path(args.prepared_dir)
    if not (prepared / INDEX_FILE).is_file():
        raise MissingInput(f"{prepared} is not a prepared data directory (no {INDEX_FILE}): "
                           "make one with `gridtrain data prepare SOURCE --out DIR`")
    png = Path(args.png) if args.png else prepared / LENGTHS_PNG
    lines = summary_lines(prepared)
    why = unwritable(png.parent)
    if why:
        raise BadInput(f"--png {png}: {why}")
    print("\n".join(lines))
    print(f"histogram of document lengths: {histogram_png(prepared, png)}")
    return 0
