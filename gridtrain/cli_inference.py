"""`gridtrain sample` and `gridtrain eval`: what a run learned, from any of its checkpoints, in one
process (gridtrain.train.inference does the work; torch loads only when a command runs)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gridtrain.argtypes import number
from gridtrain.errors import BadInput
from gridtrain.inputs import read_input

PROMPT_FILE_BYTES = 16 * 2**20
"""The largest --prompt-file read (16 MiB): the prompt is cut to the model's context anyway."""


def cmd_sample(args: argparse.Namespace, extra: list[str]) -> int:
    from gridtrain.model.generate import Sampling
    from gridtrain.train.inference import load_run, sample

    if args.prompt is not None and args.prompt_file is not None:
        raise BadInput("--prompt and --prompt-file are both given: give one")
    prompt = args.prompt if args.prompt is not None else ""
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        data = read_input(path, f"--prompt-file {path}", PROMPT_FILE_BYTES)  # before the checkpoint loads
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise BadInput(f"--prompt-file {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    run = load_run(Path(args.run_dir), args.step)
    print(f"# {run.checkpoint} ({run.cfg.model.preset}, {run.tokenizer.name} tokenizer)", file=sys.stderr)
    sample(run, prompt, args.max_new_tokens, Sampling(args.temperature, args.top_k, args.top_p), args.seed,
           args.num_samples, use_cache=not args.no_cache)
    return 0


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    from gridtrain.train.inference import evaluate, load_run, text_batches, validation_batches

    run = load_run(Path(args.run_dir), args.step)
    if args.data is not None:
        data = Path(args.data)
        batches = text_batches(run, data, args.batches or run.cfg.train.val_batches)
        source = str(data)
    else:
        batches = validation_batches(run, Path(args.run_dir), args.batches)
        source = "the run's validation split"
    result = evaluate(run, batches) | {"checkpoint": str(run.checkpoint), "data": source}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{run.checkpoint}: {source}, {result['sequences']:,} sequences, {result['tokens']:,} tokens\n"
              f"loss {result['loss']:.6f} nats/token | perplexity {result['perplexity']:.4f} | "
              f"{result['bits_per_byte']:.4f} bits/byte")
    return 0


def add_inference_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="generate text from a run's checkpoint (any layout), streamed")
    p.add_argument("run_dir")
    p.add_argument("--step", type=number(int, 0), help="the checkpoint of this step (default: the newest intact)")
    p.add_argument("--prompt", help="text to continue (default: a new document)")
    p.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")
    p.add_argument("--max-new-tokens", type=number(int, 1), default=200)
    p.add_argument("--temperature", type=number(float, 0), default=1.0,
                   help="divides the logits; 0: greedy (deterministic)")
    p.add_argument("--top-k", type=number(int, 0), default=0, help="sample among the k likeliest (0: all)")
    p.add_argument("--top-p", type=number(float, 0, 1, low_open=True), default=1.0,
                   help="sample among the likeliest tokens holding this probability (1: all)")
    p.add_argument("--seed", type=number(int, 0), default=0)
    p.add_argument("--num-samples", type=number(int, 1, 100), default=1)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence per token (no KV cache)")
    p.set_defaults(func=cmd_sample)
    p = sub.add_parser("eval", help="loss, perplexity and bits per byte of a run's checkpoint on its "
                       "validation split or on any text")
    p.add_argument("run_dir")
    p.add_argument("--step", type=number(int, 0), help="the checkpoint of this step (default: the newest intact)")
    p.add_argument("--data", help="a text file, directory or JSON lines (default: the run's validation split)")
    p.add_argument("--batches", type=number(int, 1), help="micro-batches to evaluate (default: train.val_batches, "
                   "the batches the run validated on)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval)
