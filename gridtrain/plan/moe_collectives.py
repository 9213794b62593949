"""The collectives a mixture of experts adds to a gridtrain step, as the accounting logs them: the
expert-parallel all-to-alls (parallel/expert_parallel.py) and the balance step's all-reduces
(train/balance.py). Nothing here imports torch.

Per MoE layer and micro-batch, a rank with A assignments (its tokens x top_k, fewer where capacity
drops some) that receives R rows for its own experts issues, each an all_to_all_single over the
expert-parallel group (axes.ep_axis: the flattened data- and context-parallel mesh 'dp_cp' when ep
spans it, else the experts' own 'ep' axis), logged by its input:

| when | what travels | bytes the rank logs |
|---|---|---|
| forward | counts per expert (int64) | 8 E |
| forward | dispatch: its assignments' rows (the residual stream's fp32) | 4 A dim |
| forward | combine: its experts' outputs (the compute dtype, c bytes) | c R dim |
| backward | the combine's gradient, back to the experts | c A dim |
| backward | the dispatch's gradient, back to the tokens | 4 R dim |

Recomputation (full or selective: neither keeps the all-to-alls' outputs) runs the three forward
ones again in backward. A is known before the step (dropless routing); R is not: it is how many
of every rank's assignments chose this rank's experts. Over the ep ranks R sums to A's sum, so
the all-ranks total is exact, while one rank's bytes are predicted at their expectation under
uniform routing, R = A (every rank of the group holds as many tokens), and differ by the
routing's imbalance (tiny-moe over 2 ranks at step 2: 1.2% either way; with one MoE layer 11.7%;
over 4 ranks up to 12.3%).

Under context parallelism the auxiliary loss reads its whole micro-batch's routing: per MoE layer
and micro-batch, the experts' score sums (E fp32), the token count (1) and the counts (E, as fp32)
are all-reduced over 'cp' forward, and the score sums' gradient (E) backward (model/moe.py,
reduce_stats); recomputation repeats the forward's three.
"""

from __future__ import annotations

from gridtrain.config import Config
from gridtrain.layout.dims import ParallelDims
from gridtrain.model.args import ModelArgs
from gridtrain.plan.axes import dp_axis, ep_axis, expert_norm_axis

def assignments(args: ModelArgs, tokens: int) -> float:
    """Rows one rank dispatches per MoE layer and micro-batch of `tokens` tokens: tokens x top_k,
    dropless; under a capacity at most capacity rows per expert, so under uniform routing
    E x min(tokens x top_k / E, capacity)."""
    moe = args.moe
    rows = tokens * moe.top_k
    capacity = moe.capacity(tokens)  # None: dropless
    return rows if capacity is None else moe.num_experts * min(rows / moe.num_experts, capacity)


def routed_exactly(args: ModelArgs) -> bool:
    """Whether the all-ranks total of the all-to-alls is exact: dropless routing (under a capacity
    the rows kept depend on routing too)."""
    return args.moe is not None and args.moe.capacity(1) is None


def all_to_all_bytes(args: ModelArgs, dims: ParallelDims, cfg: Config, moe_layers: int,
                     received: float | None = None) -> dict[str, float]:
    """Bytes one rank logs in a step's expert-parallel all-to-alls (the module's table) over its
    `moe_layers` MoE layers, each run by the step's micro-batches: an all_to_all_single of E
    counts, then of rows, over the expert-parallel group (axes.ep_axis). `received`: rows the rank's experts
    get per layer and micro-batch (None: its expectation under uniform routing, its own
    assignments)."""
    if dims.ep == 1 or args.moe is None or not moe_layers:
        return {}
    t = cfg.train
    sent = assignments(args, t.micro_batch * cfg.data.seq_len // dims.cp)
    got = sent if received is None else received
    compute = 4 if t.precision == "fp32" else 2
    forwards = 2 if t.recompute != "none" else 1
    per_layer = (forwards * (8 * args.moe.num_experts + (4 * sent + compute * got) * args.dim)
                 + (compute * sent + 4 * got) * args.dim)
    return {f"{ep_axis(dims)}/all_to_all_bytes": cfg.microbatches(dims.dp) * moe_layers * per_layer}


def aux_loss_bytes(args: ModelArgs, dims: ParallelDims, cfg: Config, moe_layers: int) -> dict[str, float]:
    """Context parallelism's all-reduces of the auxiliary loss's statistics (module docstring)."""
    moe = args.moe
    if dims.cp == 1 or moe is None or moe.balance != "aux_loss" or not moe.aux_loss_coef > 0:
        return {}
    forwards = 2 if cfg.train.recompute != "none" else 1
    per_layer = 4 * (forwards * (2 * moe.num_experts + 1) + moe.num_experts)
    return {"cp/all_reduce_bytes": float(cfg.microbatches(dims.dp) * moe_layers * per_layer)}


def balance_collectives(args: ModelArgs, dims: ParallelDims, moe_layers: int) -> dict[str, float]:
    """The balance step's all-reduces, once a step (train/balance.py): over each group whose ranks
    read other tokens (the 'dp' group, and 'cp'), the rank's MoE layers' int64 counts [L, E + 1]
    (the last column: the dropped assignments) and fp32 losses [L, 2] (aux, z); under a pipeline,
    on every rank, the whole model's metrics over 'pp'."""
    if args.moe is None:
        return {}
    out: dict[str, float] = {}
    if moe_layers:
        payload = moe_layers * (8 * (args.moe.num_experts + 1) + 4 * 2)
        axes = [dp_axis(dims)] * (dims.dp > 1) + ["cp"] * (dims.cp > 1)
        out.update({f"{axis}/all_reduce_bytes": float(payload) for axis in axes})
    if dims.pp > 1:  # the whole model's metrics, from every stage: 3 float64 per layer and 2
        out["pp/all_reduce_bytes"] = 8.0 * (3 * args.n_layers + 2)
    return out


def expert_norm_bytes(dims: ParallelDims, expert_tensors: int, zero_stage: int) -> dict[str, float]:
    """The gradient norm's part for the expert-parallel experts: DTensor reduces one fp32 scalar
    per sharded tensor over the axes that shard them (axes.expert_norm_axis; parallel/grads.py)."""
    if dims.ep == 1 or not expert_tensors:
        return {}
    return {f"{expert_norm_axis(dims, zero_stage)}/all_reduce_bytes": 4.0 * expert_tensors}


def moe_step_collectives(args: ModelArgs, dims: ParallelDims, cfg: Config,
                         shapes: dict[str, tuple[int, ...]]) -> dict[str, float]:
    """What a mixture of experts adds to the step's accounted collectives on a rank holding the
    parameters `shapes`: the all-to-alls at their expectation, the experts' norm scalars, context
    parallelism's all-reduces of the auxiliary loss's statistics, and the balance step's
    all-reduces (the trainer runs it inside the step's accounting)."""
    layers = sum(name.endswith(".moe.router.gate.weight") for name in shapes)
    experts = sum(".moe.experts." in name for name in shapes)
    out = dict(all_to_all_bytes(args, dims, cfg, layers))
    parts = [expert_norm_bytes(dims, experts, cfg.parallel.zero_stage), aux_loss_bytes(args, dims, cfg, layers),
             balance_collectives(args, dims, layers)]
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0.0) + value
    return out


def routed_keys(args: ModelArgs, dims: ParallelDims) -> set[str]:
    """The collectives whose bytes on one rank depend on routing (the all-to-alls)."""
    return {f"{ep_axis(dims)}/all_to_all_bytes"} if dims.ep > 1 and args.moe is not None else set()
