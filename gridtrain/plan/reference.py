"""Published runs the planner is checked against: Megatron-LM's SC21 Table 1 (Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC21,
arXiv 2104.04473), transcribed in SC21_TABLE1 below.

Ten GPT models from 1.7B to 1T parameters on A100-80GB (Selene: 8 GPUs per node on NVSwitch,
8 x 200 Gb/s HDR InfiniBand per node), sequence 2,048, vocabulary 51,200, interleaved 1F1B, full
recomputation, data parallel degree = GPUs / (tp x pp). The measured TFLOP/s per GPU count
hardware FLOPs with the recomputed forward (the paper's Eq. 3).

The paper prints neither the micro-batch nor the interleaving factor. The planner chooses them
itself: for each row, the layout search with the row's tp and pp fixed (and cp 1, ZeRO 0 as in
Megatron-LM of 2021, no sequence parallelism, no flash attention, schedule and recomputation as
in the paper) returns the micro-batch and interleaving factor it predicts fastest among those
that fit in 80 GB.
"""

from __future__ import annotations

from dataclasses import dataclass

from gridtrain.plan import shape, specs
from gridtrain.plan.state import StateBytes
from gridtrain.plan.search import Candidate, Constraints, Problem, search
from gridtrain.plan.steptime import CALIBRATED, Efficiency


@dataclass(frozen=True)
class Sc21Row:
    params_billion: float
    num_heads: int
    hidden: int
    num_layers: int
    tp: int
    pp: int
    num_gpus: int
    global_batch_seqs: int
    measured_tflops_per_gpu: float
    seq_len: int = 2048
    vocab: int = 51_200


SC21_TABLE1 = (
    Sc21Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    Sc21Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    Sc21Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    Sc21Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    Sc21Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    Sc21Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Sc21Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Sc21Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Sc21Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Sc21Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


STATE = StateBytes.mixed()
"""The runs' precision convention, Megatron-LM 2021 with --fp16: fp16 weights and gradients, fp32
master weights and moments, 2 + 2 + 12 bytes per parameter (the ZeRO paper's count)."""


def sc21_problem(row: Sc21Row, eff: Efficiency = CALIBRATED) -> tuple[Problem, Constraints]:
    """The row as a planning problem on Selene, with the paper's fixed choices as constraints."""
    gpt = shape.gpt(row.hidden, row.num_layers, row.num_heads, row.vocab, row.seq_len)
    problem = Problem(gpt, specs.cluster("selene-a100"), row.num_gpus, row.seq_len,
                      row.global_batch_seqs, flash_attention=False, sequence_parallel=False, eff=eff,
                      state=STATE)
    fixed = Constraints(tp=row.tp, pp=row.pp, cp=1, zero_stage=0, recompute="full",
                        pp_schedule="interleaved-1f1b")
    return problem, fixed


def predict_sc21(row: Sc21Row, eff: Efficiency = CALIBRATED) -> Candidate:
    """The fastest layout the planner finds for the row (module docstring)."""
    problem, fixed = sc21_problem(row, eff)
    result = search(problem, fixed, top=1)
    if not result.ranked:
        raise ValueError(f"no layout of the {row.params_billion}B row fits: {result.leanest}")
    return result.ranked[0]


def reference_rows(eff: Efficiency = CALIBRATED) -> list[dict[str, float]]:
    """Predicted against measured for every row, as plain numbers."""
    out = []
    for row in SC21_TABLE1:
        cand = predict_sc21(row, eff)
        predicted = cand.time.hardware_tflops_per_gpu
        out.append({"params_billion": row.params_billion, "tp": row.tp, "pp": row.pp,
                    "num_gpus": row.num_gpus, "micro_batch": cand.layout.micro_batch,
                    "pp_virtual_stages": cand.layout.pp_virtual_stages,
                    "num_microbatches": cand.layout.num_microbatches,
                    "predicted_tflops_per_gpu": predicted,
                    "measured_tflops_per_gpu": row.measured_tflops_per_gpu,
                    "error_pct": 100 * (predicted / row.measured_tflops_per_gpu - 1),
                    "peak_memory_GiB": cand.memory.total / 2**30})
    return out


def render_reference(rows: list[dict[str, float]], eff: Efficiency = CALIBRATED) -> str:
    """The predicted-vs-measured table, with the constants that produced it."""
    head = (f"{'model':>7} {'tp':>3} {'pp':>3} {'GPUs':>5} {'mb':>3} {'v':>3} {'m':>5} "
            f"{'predicted':>10} {'measured':>9} {'error':>7} {'memory':>8}")
    lines = ["Megatron-LM SC21 Table 1 (A100-80GB, Selene): TFLOP/s per GPU, hardware FLOPs (Eq. 3)",
             head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['params_billion']:>6}B {r['tp']:>3} {r['pp']:>3} {r['num_gpus']:>5} "
                     f"{r['micro_batch']:>3} {r['pp_virtual_stages']:>3} {r['num_microbatches']:>5} "
                     f"{r['predicted_tflops_per_gpu']:>10.1f} {r['measured_tflops_per_gpu']:>9.0f} "
                     f"{r['error_pct']:>+6.1f}% {r['peak_memory_GiB']:>5.1f} GiB")
    worst = max(abs(r["error_pct"]) for r in rows)
    lines += [f"worst error {worst:.1f}%; micro-batch (mb) and interleaving (v) chosen by the search",
              f"constants: matmul {eff.matmul:.0%} of peak, HBM {eff.hbm:.0%}, NVLink bus bandwidth "
              f"{eff.intra_node:.0%}, inter-node {eff.inter_node:.0%}, {eff.layer_overhead_s * 1e6:.0f} us "
              "per layer per micro-batch"]
    return "\n".join(lines)
