"""A mixture-of-experts feed-forward for one device: router, routed SwiGLU experts stored stacked,
shared experts, load balance. Nothing here knows about parallelism.

One micro-batch of N tokens (x: (N, dim)):
1. The router scores every expert in fp32 (softmax or sigmoid of x W_r^T) and picks each token's
   top k: by score, or by score + expert bias under the DeepSeek-V3 balance (the bias chooses,
   the gate values stay the scores). The k gate values are optionally renormalised and scaled.
2. The N k (token, expert) assignments are sorted by expert (stable: token order within an
   expert); with a capacity factor each expert keeps its first `capacity` and drops the rest
   (in training; a module in eval mode routes dropless, as DeepSeek-V2 (2024, §2.2.3) may at inference).
3. The experts run on their contiguous groups, through `torch._grouped_mm` with the groups' end
   offsets, or a loop over the experts (the same numbers, bit for bit).
4. Each assignment's output is put back in (token, choice) order and the k outputs of a token
   summed with their gate values; a dropped assignment adds nothing (the token keeps its residual).

Balance losses reach the gradient without touching the training loss: `attach_loss` returns the
layer's output unchanged and, in backward, gives the loss its gradient, scaled as the trainer
scales the language-model loss (Megatron-LM's MoEAuxLossAutoScaler does the same). So they work
under gradient accumulation, recomputation and pipeline schedules alike.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gridtrain.model.moe_args import MoEArgs


def _recomputing() -> bool:
    """Whether this forward runs inside backward (activation checkpointing recomputes a block):
    its routing was counted when it first ran."""
    return torch._C._current_graph_task_id() != -1


class _AttachLoss(torch.autograd.Function):
    """Identity on `out`; in backward, `loss` gets the gradient `scale` (the factor the trainer
    multiplies the language-model loss by before its backward: 1 / micro-batches, times fp16's
    loss scale)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.loss_meta = (loss.shape, loss.dtype)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        shape, dtype = ctx.loss_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=grad.device), None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: torch._grouped_mm's backward fails on
    a stride-0 one (the gradient of a sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad.contiguous()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would multiply in here (the input's own outside autocast): the experts'
    stacked weights go through no nn.Linear, so they are cast by hand."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def experts_forward(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                    grouped: bool) -> torch.Tensor:
    """SwiGLU of each expert over its contiguous group of rows: x (M, dim) sorted by expert, `counts`
    (E,) rows per expert; w1, w3 (E, ffn, dim), w2 (E, dim, ffn). Returns (M, dim)."""
    dtype = compute_dtype(x)
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    if grouped:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
        return _ContiguousGrad.apply(torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets))
    outs = []
    for rows, e1, e2, e3 in zip(torch.split(x, counts.tolist()), w1.unbind(0), w2.unbind(0), w3.unbind(0)):
        outs.append((F.silu(rows @ e1.T) * (rows @ e3.T)) @ e2.T)
    return torch.cat(outs)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: w1 and w3 (E, ffn, dim), w2 (E, dim, ffn), each slice laid
    out as nn.Linear's weight, so expert e's w1 is `w1[e]` wherever a checkpoint is loaded."""

    def __init__(self, dim: int, ffn: int, num_experts: int, grouped: bool) -> None:
        super().__init__()
        self.grouped = grouped
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, ffn))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return experts_forward(x, counts, self.w1, self.w2, self.w3, self.grouped)


class Router(nn.Module):
    """Scores, top-k choice and gate values of each token, in fp32 whatever the autocast (from the
    gate's weight rounded to the autocast dtype, which is what FSDP's mixed precision gathers)."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """Returns (logits, scores) of shape (N, E) and (gates, experts) of shape (N, k)."""
        a = self.args
        # fp32 scores from the weight as the layer's matmuls see it: rounded to the autocast dtype, as
        # FSDP gathers it under mixed precision (a layout that routed by the fp32 weight here and by
        # the 16-bit one there would send tokens near a tie to other experts).
        weight = self.gate.weight.to(compute_dtype(x)).float()
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), weight)
        scores = torch.softmax(logits, dim=-1) if a.score == "softmax" else torch.sigmoid(logits)
        choose = scores if bias is None else scores + bias
        experts = torch.topk(choose.detach(), a.top_k, dim=-1).indices
        gates = scores.gather(-1, experts)
        if a.normalize_top_k:
            gates = gates / (gates.sum(dim=-1, keepdim=True) + (1e-20 if a.score == "sigmoid" else 0.0))
        return logits, scores, gates * a.route_scale, experts


def aux_loss(prob_sums: torch.Tensor, counts: torch.Tensor, tokens: int | torch.Tensor, args: MoEArgs) -> torch.Tensor:
    """The Switch / GShard load-balancing loss, alpha E sum_i f_i P_i, over a micro-batch of
    `tokens`: f_i the fraction of its tokens x k assignments that chose expert i (`counts`, no
    gradient), P_i the mean over its tokens of expert i's score (`prob_sums`: the scores summed over
    tokens; sigmoid scores normalised per token first). Equal to alpha when routing is uniform."""
    f = counts.float() / (tokens * args.top_k)
    return args.aux_loss_coef * args.num_experts * (f * prob_sums / tokens).sum()


def prob_sums(scores: torch.Tensor, args: MoEArgs) -> torch.Tensor:
    """Each expert's scores summed over the tokens, as the auxiliary loss reads them."""
    probs = scores if args.score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    return probs.sum(dim=0)


def z_loss(logits: torch.Tensor, coef: float) -> torch.Tensor:
    """The router z-loss of ST-MoE: coef x mean over tokens of logsumexp(logits)^2."""
    return coef * torch.logsumexp(logits, dim=-1).square().mean()


def dispatch_order(experts: torch.Tensor, num_experts: int, capacity: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, choice) assignments sorted by expert, token order within one, and rows per expert;
    with a capacity, each expert's assignments past it left out. Indices are into experts.flatten()."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    if capacity is None:
        return order, counts
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    kept = order[rank_in_expert < capacity]
    return kept, counts.clamp(max=capacity)


class MoE(nn.Module):
    """The mixture-of-experts feed-forward of one block: x (B, T, dim) -> (B, T, dim).

    Buffers: `expert_bias` (E,), saved in checkpoints, moved only by the balance step between
    optimizer steps; `tokens_per_expert` (E,), the step's choices so far, and `dropped`, the
    assignments dropped by capacity, both zeroed by whoever reads them (the trainer, once a step).
    """

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        self.experts = GroupedExperts(dim, args.expert_ffn_dim, args.num_experts, args.grouped_mm)
        self.shared = None
        if args.num_shared_experts:
            from gridtrain.model.llama import FeedForward

            self.shared = FeedForward(dim, args.num_shared_experts * args.expert_ffn_dim)
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("dropped", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("balance_losses", torch.zeros(2), persistent=False)
        """(aux, z) summed over this step's micro-batches, for the log."""
        self.loss_scale = 1.0
        """The factor the trainer multiplies each micro-batch's loss by before backward."""
        self.reduce_stats: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Sums a tensor over the ranks that hold the other tokens of this micro-batch (context
        parallelism sets it; its backward sums the gradients likewise), so the auxiliary loss is the
        whole micro-batch's; None: this rank holds all of them."""
        self.counting = True
        """Whether this forward's routing counts toward the step (off while a pipeline stage runs a
        forward only to learn its tensors' shapes)."""
        self.fixed_routing: Callable[[int], tuple[torch.Tensor, ...]] | None = None
        """A dry run's routing without values (train/dry_run.py): tokens -> (experts, order, kept
        counts, counts), the counts as real tensors whose values a fake forward can read."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, (B, T, D) = self.args, x.shape
        tokens = x.reshape(-1, D)
        bias = self.expert_bias if a.balance == "bias" else None
        logits, scores, gates, experts = self.router(tokens, bias)
        if self.fixed_routing is not None:
            experts, order, kept_counts, counts = self.fixed_routing(tokens.shape[0])
        else:
            # Capacity binds in training only: in validation, evaluation and sampling a token's output
            # must not depend on how many tokens share its forward (a cached decode step holds one).
            capacity = a.capacity(tokens.shape[0]) if self.training else None
            order, kept_counts = dispatch_order(experts, a.num_experts, capacity)
            counts = torch.bincount(experts.flatten(), minlength=a.num_experts)
        routed = self.experts(tokens[order // a.top_k], kept_counts)
        # Back to (token, choice) order; dropped assignments stay zero.
        placed = routed.new_zeros(experts.numel(), D).index_copy(0, order, routed)
        out = (placed.view(-1, a.top_k, D) * gates.unsqueeze(-1).to(placed.dtype)).sum(dim=1)
        if self.shared is not None:
            out = out + self.shared(tokens)
        out = out.view(B, T, D)
        if self.training and torch.is_grad_enabled():
            out = self._balance(out, logits, scores, counts, experts.numel() - order.numel())
        return out

    def _balance(self, out: torch.Tensor, logits: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor,
                 dropped: int) -> torch.Tensor:
        """Attach the balance losses to the output's backward; count the step's routing (once: not
        again when a checkpointed block is recomputed)."""
        a = self.args
        losses = []
        if a.balance == "aux_loss" and a.aux_loss_coef > 0:
            sums, all_counts, tokens = prob_sums(scores, a), counts, scores.new_tensor(float(scores.shape[0]))
            if self.reduce_stats is not None:  # the whole micro-batch's, over the ranks that share it
                sums, tokens = self.reduce_stats(sums), self.reduce_stats(tokens)
                all_counts = self.reduce_stats(counts.float()).detach()
            losses.append(aux_loss(sums, all_counts, tokens, a))
        if a.z_loss_coef > 0:
            losses.append(z_loss(logits, a.z_loss_coef))
        if self.counting and not _recomputing():
            with torch.no_grad():
                self.tokens_per_expert += counts
                self.dropped += dropped
                if a.balance == "aux_loss" and a.aux_loss_coef > 0:
                    self.balance_losses[0] += losses[0].detach()
                if a.z_loss_coef > 0:
                    self.balance_losses[1] += losses[-1].detach()
        if losses:
            out = _AttachLoss.apply(out, sum(losses), self.loss_scale)
        return out


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(name, module) of every MoE feed-forward in `model`, in order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


@contextlib.contextmanager
def routing_uncounted(model: nn.Module) -> Iterator[None]:
    """Forwards inside leave the MoE layers' step counters alone (a shape-probing forward)."""
    layers = [layer for _, layer in moe_layers(model)]
    for layer in layers:
        layer.counting = False
    try:
        yield
    finally:
        for layer in layers:
            layer.counting = True
