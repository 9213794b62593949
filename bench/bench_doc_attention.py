"""Document-masked attention (gridtrain.model.documents) against unmasked causal attention,
forward and backward, in one process.

    python bench/bench_doc_attention.py                       # seq 2048 and 8192; 4 and 16 documents
    python bench/bench_doc_attention.py --seq 2048 --docs 4 --repeat 5 --dtype bf16 --threads 1

Shape: batch 1, 8 heads of 64 (the m26 model's attention width), torch's threads or --threads. A sequence of
`seq` tokens holds `docs` documents of equal length ("equal") or of lengths drawn at random
(Dirichlet(1), seed 0: one long document and several short ones, as packing real text gives).
For each: SDPA with is_causal=True (no mask: what attention across documents costs), SDPA with
the dense document mask, and document_attention (our blockwise kernel, masked blocks skipped);
the best of --repeat timings of forward plus backward (the three taking turns, so a busy stretch
of a shared machine falls on all alike), and each over SDPA causal's time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_attention import best_ms  # noqa: E402
from gridtrain.model.documents import Documents, document_attention  # noqa: E402


def document_ids(seq: int, docs: int, layout: str) -> torch.Tensor:
    """(1, seq) document ids: `docs` documents of equal or random lengths (each at least 1 token)."""
    if layout == "equal":
        lengths = [seq // docs] * docs
    else:
        share = np.random.default_rng(0).dirichlet(np.ones(docs))
        lengths = list(np.maximum(1, np.floor(share * seq)).astype(int))
    lengths[-1] += seq - sum(lengths)
    return torch.repeat_interleave(torch.arange(docs), torch.tensor(lengths))[None]


def best_of_rounds(fns: dict[str, object], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
                   repeat: int) -> dict[str, float]:
    """Each function's best forward + backward time (ms), the functions taking turns `repeat`
    times, so a busy stretch of a shared machine falls on all of them alike."""
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            best[name] = min(best[name], best_ms(fn, q, k, v, grad, 1))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--docs", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--layout", nargs="+", default=["equal", "random"], choices=["equal", "random"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch 1, 8 heads x 64, {args.dtype}; "
          f"forward + backward, best of {args.repeat} taking turns; x: time over SDPA causal's (no mask)")
    for seq in args.seq:
        q, k, v = (torch.randn(1, 8, seq, 64, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(1, 8, seq, 64, dtype=dtype)
        for docs in args.docs:
            for layout in args.layout:
                ids = document_ids(seq, docs, layout)
                mask = ((ids[:, :, None] == ids[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril())[:, None]
                ms = best_of_rounds({
                    "causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    "dense": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                    "ours": lambda q, k, v: document_attention(q, k, v, Documents(ids))}, q, k, v, grad, args.repeat)
                causal = ms["causal"]
                print(f"seq {seq:>5}, {docs:>2} documents ({layout:>6}): SDPA causal {causal:7.1f} ms | SDPA dense "
                      f"mask {ms['dense']:7.1f} ms ({ms['dense'] / causal:.2f}x) | document_attention "
                      f"{ms['ours']:7.1f} ms ({ms['ours'] / causal:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
