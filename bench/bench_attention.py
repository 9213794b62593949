"""Blockwise causal attention (gridtrain.model.blockwise) against torch's causal SDPA, forward and
backward, in one process.

    python bench/bench_attention.py                      # seq 512, 2048, 8192; fp32 and bf16
    python bench/bench_attention.py --seq 2048 --chunks 2 4 --repeat 5

Shape: batch 1, 8 heads of 64 (the m26 model's attention width), torch's default threads. For
each sequence length and dtype: SDPA with is_causal=True, the same with a full mask (what a
kernel that does not skip masked tiles would cost), and blockwise causal attention in each number
of chunks; the best of --repeat timings of forward plus backward, and SDPA causal's time over
each (above 1: blockwise is faster).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gridtrain.model.blockwise import blockwise_causal_attention  # noqa: E402


def best_ms(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, repeat: int) -> float:  # noqa: ANN001
    fn(q, k, v).backward(grad)  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(q, k, v).backward(grad)
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch 1, 8 heads x 64; forward + backward, best of {args.repeat}")
    for seq in args.seq:
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(1, 8, seq, 64, dtype=dtype, requires_grad=True) for _ in range(3))
            grad = torch.randn(1, 8, seq, 64, dtype=dtype)
            causal = best_ms(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v, grad, args.repeat)
            full = best_ms(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v, grad, args.repeat)
            row = [f"seq {seq:>5} {str(dtype).removeprefix('torch.'):>8}: SDPA causal {causal:8.1f} ms, full {full:8.1f} ms"]
            for chunks in args.chunks:
                ms = best_ms(lambda q, k, v, c=chunks: blockwise_causal_attention(q, k, v, c), q, k, v, grad, args.repeat)
                row.append(f"{chunks} chunks {ms:8.1f} ms ({causal / ms:.2f}x)")
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
