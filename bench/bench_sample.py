"""Decoding speed with and without the KV cache: tokens/s of greedy generation from a prompt, one
process, one sequence, the model initialised from its seed (the speed does not depend on the
weights).

    python bench/bench_sample.py [--preset small] [--prompt-tokens 64] [--new-tokens 256] [--repeats 3]

Without the cache each new token runs the whole sequence so far through the model (the training
forward); with it, one position through each layer against the cached keys and values. Prints the
median tokens/s of each and their ratio, and checks that both produced the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gridtrain.model.args import model_args  # noqa: E402
from gridtrain.model.generate import Sampling, generate  # noqa: E402
from gridtrain.train.build import build_model  # noqa: E402


def timed(model, prompt: torch.Tensor, new: int, use_cache: bool) -> tuple[float, list[int]]:
    start = time.perf_counter()
    tokens = [int(t[0]) for t in generate(model, prompt, new, Sampling(temperature=0), use_cache=use_cache)]
    return new / (time.perf_counter() - start), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(model_args(args.preset), 0, torch.device("cpu")).eval()
    prompt = torch.randint(0, model.args.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    results = {}
    for use_cache in (True, False):
        runs = [timed(model, prompt, args.new_tokens, use_cache) for _ in range(args.repeats)]
        results[use_cache] = (statistics.median(r[0] for r in runs), runs[0][1])
    assert results[True][1] == results[False][1], "the cache changed the greedy tokens"
    with_cache, without = results[True][0], results[False][0]
    print(f"{args.preset}: {args.prompt_tokens}-token prompt + {args.new_tokens} new tokens, {torch.get_num_threads()} "
          f"threads, median of {args.repeats}")
    print(f"  KV cache     {with_cache:9.1f} tokens/s")
    print(f"  no cache     {without:9.1f} tokens/s")
    print(f"  ratio        {with_cache / without:9.2f}x (same greedy tokens)")


if __name__ == "__main__":
    main()
