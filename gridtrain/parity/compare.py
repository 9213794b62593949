"""Is a parallel run the same training as one process? Per-step losses, per-step gradient norms
(taken before clipping, with clipping active) and the gathered weights, against the one-process
run of the same configuration, within tolerances derived from the precision.

fp32. A layout only changes the order of floating-point sums: losses and gradient norms within
1e-5 relative, every weight element within 1e-5 (absolute and relative).

bf16 and fp16. A layout may round differently: tensor parallelism rounds each rank's partial sum
before the all-reduce, FSDP gathers parameters in the training dtype. Each such rounding moves a
value by at most the unit roundoff u (2^-8 for bf16, 2^-11 for fp16). The bounds, in units of u:
- loss: the mean over N tokens of per-token perturbations of relative size u, independent from
  token to token: relative standard deviation u / sqrt(N); bound 4 u / sqrt(N).
- gradient norm: a rounding of the parameters moves every gradient by up to u, coherently; bound u.
- weights, per tensor: the relative error of the tensor's update over the run,
  ||(W - W0) - (W_ref - W0)|| / ||W_ref - W0||. Each step's update follows gradients that differ
  by a few roundings of u (one per matmul on the backward path), amplified where a sum over the
  tokens cancels (the norm weights' gradients): bound 16 u per step. And every element within
  Adam's largest possible step difference, 2 x sum_t lr_t R_t, where R_t bounds
  |m_hat / sqrt(v_hat)| at step t (Cauchy-Schwarz over the moment sums; about 1 for b1^2 < b2).
Mixture of experts in bf16 and fp16: the router's top-k choice is discrete. A token whose k-th
and (k+1)-th scores are closer than a layout's rounding moves them (about u of the hidden state
the router reads) goes to another expert in one of the runs: measured on the matrix's tiny-moe
under TP 2 in fp16, one token of 256 in about one router call of 4, at score gaps of 1.5e-6 to
9e-6 where the two runs' scores differ by up to 2e-5. The expert then has one of its about T k / E
assignments of a step more or less (T tokens a step, each to k of E experts), which moves its
gradient, and with the matrix's Adam epsilon its update, by about E / (T k) of itself when the
tokens' gradients agree (more where they cancel: this is an allowance fitted to what was
measured, 1.4% to 2.0% for one flip at E / (T k) = 1.6%, not a bound). Allowance: one such token
per expert and step, weighing up to twice the mean assignment, 2 E / (T k) per step added to the
16 u of the experts, the router and the FFN norms in front of them (the tensors a moved token's
gradient reaches through its own expert); every other tensor keeps 16 u. fp32 rounds 2^13 times
finer than fp16, and no tie that close was met there.
FP8 (train.float8, beside bf16) against the bf16 run of one process: the block linears round
both operands of every matmul to e4m3 (3 mantissa bits, unit roundoff u = 2^-4; Micikevicius et
al. 2022, "FP8 Formats for Deep Learning", table 1) after scaling, where bf16 rounded to 2^-8: the
same derivation with u = 2^-4 gives losses within 4 u / sqrt(N) and gradient norms within u: the
coherent part of a gradient's change is the weights' e4m3 rounding, as bf16's was the parameters'.
(The tensorwise recipe's backward rounds output gradients to e5m2, up to 2^-3 each, but
independently element by element, so a norm over thousands of them moves far less.)

Adam's update is nearly blind to a gradient's scale (m / sqrt(v)), which would hide a wrongly
scaled or unclipped gradient in the weights; the matrix therefore runs with an epsilon near the
gradients' RMS (matrix.ADAM_EPS), where it is not. The README ("Parity") gives the largest
deviations measured over the whole matrix against these bounds, and what a run on other data or
without the reference's clipping shows.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from gridtrain.parity.run import Result

UNIT_ROUNDOFF = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp8": 2.0 ** -4}
"""Half the distance from 1 to the next number: 2^-(mantissa bits + 1); 'fp8' is e4m3."""
FP32_TOL = 1e-5


@dataclass(frozen=True)
class Tolerance:
    loss_rtol: float
    norm_rtol: float
    weight_tol: float | None  # elementwise, absolute and relative (fp32); None in low precision
    update_rtol: float | None  # per tensor, relative error of the update (low precision)
    max_abs: float  # no element further than this (Adam's bound)
    routed_update_rtol: float | None = None  # update_rtol of a mixture of experts' routed tensors (ROUTED)


ROUTED = re.compile(r"(^|\.)(moe|ffn_norm)\.")
"""The tensors a token moved to another expert reaches through that expert: the experts, the
router and the FFN norm before them."""


def adam_ratio_bound(step: int, beta1: float, beta2: float) -> float:
    """Largest |m_hat / sqrt(v_hat)| at 1-based step t for any gradients: by Cauchy-Schwarz,
    (1-b1) sqrt(1-b2^t) / ((1-b1^t) sqrt(1-b2)) x sqrt(sum_{j<t} (b1^2/b2)^j)."""
    series = sum((beta1 ** 2 / beta2) ** j for j in range(step))
    return ((1 - beta1) * math.sqrt(1 - beta2 ** step) / ((1 - beta1 ** step) * math.sqrt(1 - beta2))
            * math.sqrt(series))


def tolerance(precision: str, tokens_per_step: int, lrs: list[float], beta1: float, beta2: float,
              routing: tuple[int, int] | None = None) -> Tolerance:
    """The bounds for a run of len(lrs) steps in `precision` (module docstring); `routing`: a
    mixture of experts' (experts, top-k)."""
    max_abs = 2 * sum(lr * adam_ratio_bound(t + 1, beta1, beta2) for t, lr in enumerate(lrs))
    if precision == "fp32":
        return Tolerance(FP32_TOL, FP32_TOL, FP32_TOL, None, max_abs)
    u = UNIT_ROUNDOFF[precision]
    routed = None if routing is None else (16 * u + 2 * routing[0] / (tokens_per_step * routing[1])) * len(lrs)
    return Tolerance(4 * u / math.sqrt(tokens_per_step), u, None, 16 * u * len(lrs), max_abs, routed)


def routing_of(overrides: dict[str, object]) -> tuple[int, int] | None:
    """(experts, top-k) of the mixture of experts these overrides train; None for a dense model."""
    from gridtrain.config_load import load_config

    moe = load_config(None, {k: v for k, v in overrides.items() if k.startswith("model.")}).model.args().moe
    return None if moe is None else (moe.num_experts, moe.top_k)


@dataclass
class Deviation:
    """How far a run is from the reference: per step, and per weight tensor."""

    losses: list[tuple[float, float]]  # (run, reference) per step
    grad_norms: list[tuple[float, float]]
    max_abs: dict[str, float]  # largest element difference
    beyond: dict[str, int]  # elements beyond the fp32 tolerance
    update: dict[str, float]  # relative error of the update (`update_error`)
    numel: dict[str, int]
    unmatched: list[str]  # weights one side has and the other lacks, or of another shape
    init_differs: list[str]  # weights whose initial values are not one process's, bit for bit

    def summary(self) -> dict[str, float]:
        """The largest deviation of each kind (relative loss and norm, update error, element)."""
        return {"loss_rel": max(_relative(self.losses), default=0.0),
                "grad_norm_rel": max(_relative(self.grad_norms), default=0.0),
                "update_rel": max(self.update.values(), default=0.0),
                "max_abs": max(self.max_abs.values(), default=0.0),
                "beyond_fp32_share": sum(self.beyond.values()) / max(1, sum(self.numel.values()))}


def _relative(pairs: list[tuple[float, float]]) -> list[float]:
    return [abs(g - w) / max(abs(w), 1e-30) if math.isfinite(g) else math.inf for g, w in pairs]


def deviation(run: Result, ref: Result) -> Deviation:
    dev = Deviation(list(zip(run.losses, ref.losses)), list(zip(run.grad_norms, ref.grad_norms)),
                    {}, {}, {}, {}, [], [])
    dev.init_differs = [key for key, value in ref.initial.items()
                        if key not in run.initial or not torch.equal(run.initial[key], value)]
    if len(run.losses) != len(ref.losses) or len(run.grad_norms) != len(ref.grad_norms):
        dev.unmatched.append(f"{len(run.losses)} steps where one process has {len(ref.losses)}")
    for key in sorted(set(ref.weights) | set(run.weights)):
        got, want = run.weights.get(key), ref.weights.get(key)
        if got is None or want is None or got.shape != want.shape:
            dev.unmatched.append(key)
            continue
        got, want = got.float(), want.float()
        diff = (got - want).abs()
        dev.max_abs[key] = diff.max().item() if diff.numel() else 0.0
        dev.beyond[key] = int((diff > FP32_TOL + FP32_TOL * want.abs()).sum())
        dev.update[key] = update_error(got, want, ref.initial[key].float())
        dev.numel[key] = diff.numel()
    return dev


def problems(dev: Deviation, tol: Tolerance) -> list[str]:
    """What differs beyond the tolerance (empty: the run is the reference's training)."""
    out = [f"not in both: {what}" for what in dev.unmatched]
    out += [f"{key}: the initial weights are not one process's, bit for bit" for key in dev.init_differs]
    for what, pairs, rtol in (("loss", dev.losses, tol.loss_rtol), ("gradient norm", dev.grad_norms, tol.norm_rtol)):
        for step, ((g, w), rel) in enumerate(zip(pairs, _relative(pairs)), start=1):
            if not rel <= rtol:  # also catches NaN
                out.append(f"step {step} {what} {g:.7g} vs {w:.7g} (relative {rel:.2e} > {rtol:.2e})")
    for key, worst in dev.max_abs.items():
        if not worst <= tol.max_abs:
            out.append(f"{key}: an element differs by {worst:.3g} > {tol.max_abs:.3g} (Adam's largest step difference)")
        if tol.weight_tol is not None and dev.beyond[key]:
            out.append(f"{key}: {dev.beyond[key]} of {dev.numel[key]} elements differ beyond "
                       f"{tol.weight_tol:g} (largest {worst:.3g})")
        bound = tol.routed_update_rtol if tol.routed_update_rtol is not None and ROUTED.search(key) else tol.update_rtol
        if bound is not None and not dev.update[key] <= bound:
            out.append(f"{key}: the update differs by {dev.update[key]:.3g} of its size > {bound:.3g}")
    return out


def compare(run: Result, ref: Result, tol: Tolerance) -> list[str]:
    """`problems` of the run's `deviation` from the reference."""
    return problems(deviation(run, ref), tol)


def update_error(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor) -> float:
    """||(got - start) - (want - start)|| / ||want - start||: how far the run's update of a tensor
    is from the reference's, relative to its size (0 where neither moved)."""
    moved = (want - start).norm().item()
    gap = (got - want).norm().item()
    return gap / moved if moved > 0 else (0.0 if gap == 0 else math.inf)
