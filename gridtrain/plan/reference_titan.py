"""Published runs of PyTorch-native training the planner's 'eager' and 'compiled' efficiencies are
fixed by: torchtitan's H100 benchmark (Liang et al., "TorchTitan: One-stop PyTorch native solution
for production ready LLM pre-training", arXiv 2410.06511; the figures of
benchmarks/llama3_h100_202412_torchtitan.md in the torchtitan repository, December 2024).

The hosts are Grand Teton: 8 H100 per host with 96 GB of HBM2e at 2.4 TB/s, a 500 W power limit,
NVLink within the host and 400 Gb/s RDMA per GPU between hosts. Llama 3.1 8B, sequence 8,192, local
batch 2, bf16 with fp32 gradient reduction, FSDP over every GPU (ZeRO-3), selective activation
checkpointing, AdamW. Throughput is read at iteration 90, memory is the largest 'max reserved'
across the GPUs, and the benchmark's MFU divides by the H100 SXM's dense 989 TFLOP/s.

Only the rows without Float8 are here (Tables 1 and 3); the rest of the benchmark (CP, TP, PP, the
405B runs) trains its linear layers in Float8, which the planner does not cost.

Memory: the planner predicts what its buckets allocate at the peak; 'reserved' is what PyTorch's
caching allocator holds from the driver, which adds the blocks it keeps cached between
allocations and their fragmentation (the CUDA context and NCCL's own buffers lie outside both).
The planner leaves that share out of a layout's budget through --hbm-usable (0.9 by default).
"""

from __future__ import annotations

from dataclasses import dataclass

from gridtrain.model.args import PRESETS
from gridtrain.plan import shape, specs
from gridtrain.plan.search import Candidate, Constraints, Problem, search
from gridtrain.plan.steptime import IMPLEMENTATIONS

SOURCE = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Liang et al., arXiv 2410.06511): "
          "Llama 3.1 8B, FSDP, local batch 2, seq 8,192, selective AC, bf16, Grand Teton H100 96 GB")


@dataclass(frozen=True)
class TitanRow:
    num_gpus: int
    implementation: str
    """'eager' or 'compiled' (torch.compile): the key into steptime.IMPLEMENTATIONS."""
    tokens_per_s_per_gpu: float
    max_reserved_GiB: float
    table: str
    local_batch: int = 2
    seq_len: int = 8192


TORCHTITAN_H100 = (
    TitanRow(8, "eager", 5762, 82.4, "Table 1"),
    TitanRow(8, "compiled", 6667, 77.0, "Table 1"),
    TitanRow(128, "eager", 5605, 67.0, "Table 3"),
    TitanRow(128, "compiled", 6514, 62.0, "Table 3"),
)


def titan_problem(row: TitanRow) -> tuple[Problem, Constraints]:
    """The row as a planning problem, with the benchmark's choices fixed. All of HBM is offered
    (hbm_usable 1) so that the prediction is the allocation itself, compared with 'reserved'."""
    llama = shape.from_args(PRESETS["llama3-8b"]())
    problem = Problem(llama, specs.cluster("grand-teton-h100-96gb"), row.num_gpus, row.seq_len,
                      row.local_batch * row.num_gpus, hbm_usable=1.0, eff=IMPLEMENTATIONS[row.implementation],
                      model_keys=(("model.preset", "llama3-8b"),))
    fixed = Constraints(dp=row.num_gpus, dp_shard=row.num_gpus, tp=1, pp=1, cp=1, zero_stage=3,
                        micro_batch=row.local_batch, recompute="selective")
    return problem, fixed


def predict_titan(row: TitanRow) -> Candidate:
    problem, fixed = titan_problem(row)
    result = search(problem, fixed, top=1)
    if not result.ranked:
        raise ValueError(f"the torchtitan row {row} does not fit: {result.leanest}")
    return result.ranked[0]


def titan_rows() -> list[dict[str, object]]:
    """Predicted against published for every row, as plain values."""
    out: list[dict[str, object]] = []
    for row in TORCHTITAN_H100:
        cand = predict_titan(row)
        tps = cand.time.tokens_per_s / row.num_gpus
        memory = cand.memory.total / 2**30
        out.append({"num_gpus": row.num_gpus, "implementation": row.implementation, "table": row.table,
                    "predicted_tokens_per_s_per_gpu": tps,
                    "published_tokens_per_s_per_gpu": row.tokens_per_s_per_gpu,
                    "tokens_error_pct": 100 * (tps / row.tokens_per_s_per_gpu - 1),
                    "mfu_pct": 100 * cand.time.mfu,
                    "predicted_memory_GiB": memory, "max_reserved_GiB": row.max_reserved_GiB,
                    "memory_error_pct": 100 * (memory / row.max_reserved_GiB - 1)})
    return out


def render_titan(rows: list[dict[str, object]]) -> str:
    """The predicted-vs-published table."""
    head = (f"{'GPUs':>5} {'kernels':>9} {'tokens/s/GPU':>13} {'published':>10} {'error':>7} {'MFU':>6} "
            f"{'memory':>10} {'reserved':>9} {'error':>7}")
    lines = ["torchtitan's H100 benchmark (Llama 3.1 8B, FSDP, bf16, selective AC; Tables 1 and 3)",
             head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['num_gpus']:>5} {r['implementation']:>9} {r['predicted_tokens_per_s_per_gpu']:>13,.0f} "
                     f"{r['published_tokens_per_s_per_gpu']:>10,.0f} {r['tokens_error_pct']:>+6.1f}% "
                     f"{r['mfu_pct']:>5.1f}% {r['predicted_memory_GiB']:>6.1f} GiB {r['max_reserved_GiB']:>5.1f} GiB "
                     f"{r['memory_error_pct']:>+6.1f}%")
    lines.append("memory: the planner's peak allocation against the caching allocator's max reserved "
                 "(reserved adds its cached blocks and fragmentation)")
    lines.append(f"kernels: matmul {IMPLEMENTATIONS['eager'].matmul:.0%} of peak eager, "
                 f"{IMPLEMENTATIONS['compiled'].matmul:.0%} under torch.compile (plan --implementation)")
    return "\n".join(lines)
