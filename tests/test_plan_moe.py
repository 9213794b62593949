"""The planner's model of a mixture of experts, against numbers derived by hand and against the
runtime's own counts: the shape and its parameters (plan/shape.py), a rank's state tensor by
tensor (plan/census.py) and the step's all-to-alls (plan/moe_collectives.py)."""

from __future__ import annotations

import dataclasses

import pytest

from gridtrain.config_load import load_config
from gridtrain.model.args import PRESETS, model_args
from gridtrain.plan.axes import ep_axis
from gridtrain.plan.check_run import predict_rank
from gridtrain.plan.flops import flops_per_token
from gridtrain.plan.moe_collectives import all_to_all_bytes, balance_collectives
from gridtrain.plan.run_collectives import collectives
from gridtrain.plan.shape import ModelShape, from_args, param_counts
from gridtrain.validate import parallel_dims

MOE_PRESETS = [name for name, make in PRESETS.items() if make().moe is not None]
# Dense first layers, MoE every other layer after them, two shared experts, QK-norm and wide heads.
MIXED = dataclasses.replace(
    model_args("tiny-moe", moe={"first_dense": 1, "every": 2, "num_shared_experts": 2}),
    n_layers=6, explicit_head_dim=24, qk_norm=True)


@pytest.mark.parametrize("args", [PRESETS[n]() for n in MOE_PRESETS] + [MIXED], ids=MOE_PRESETS + ["mixed"])
def test_shape_counts_the_parameters_as_the_runtime_does(args):
    """Total, active and by part: the model's own count, built on the meta device."""
    from gridtrain.model.stats import flops_per_token as runtime_flops
    from gridtrain.model.stats import model_parameters

    shape = from_args(args)
    assert param_counts(shape) == model_parameters(args)
    assert flops_per_token(shape, 512) == runtime_flops(args, 512)


def test_mixtral_and_qwen3_totals_and_active():
    """The published figures: Mixtral 8x7B 46.7B parameters, 12.9B active; Qwen3-30B-A3B 30.5B and
    "3.3B" active (3.35B: the report's figure is cut, not rounded)."""
    mixtral, qwen = (param_counts(from_args(PRESETS[n]())) for n in ("mixtral-8x7b", "qwen3-30b-a3b"))
    assert round(mixtral.total / 1e9, 1) == 46.7 and round(mixtral.active / 1e9, 1) == 12.9
    assert round(qwen.total / 1e9, 1) == 30.5 and 3.3e9 <= qwen.active < 3.4e9


def test_the_moe_layer_rule_in_constant_time():
    shape = from_args(MIXED)
    assert [shape.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    for start in range(7):
        for stop in range(start, 7):
            assert shape.moe_layers_in(start, stop) == sum(shape.is_moe_layer(i) for i in range(start, stop))
    assert ModelShape(64, 4, 4, 4, 128, 320).num_moe_layers == 0


def tiny_moe(**overrides: object):
    cfg = load_config(None, {"model.preset": "tiny-moe", "data.seq_len": 32, "train.micro_batch": 2,
                             "train.global_batch": 8, **overrides})
    return cfg, parallel_dims(cfg, 2), cfg.model.args()


EP2_FSDP2 = {"parallel.ep": 2, "parallel.zero_stage": 3, "parallel.dp_shard": 2, "parallel.dp_replicate": 1}


def test_tiny_moe_state_per_rank_under_ep2_fsdp2():
    """By hand: each MoE layer's experts are 3 x 8 x 32 x 64 = 49,152 elements, 4 of the 8 experts
    per rank under ep 2 (24,576 per layer, 49,152 for both), left alone by FSDP. The rest is
    66,880 elements (embedding 20,480; per block norms 128, wq 4,096, wk and wv 2,048 each, wo
    4,096, router 512; final norm 64, head 20,480), every first dimension even, so FSDP keeps
    33,440. fp32 weights and gradients: (49,152 + 33,440) x 4 = 330,368 bytes; AdamW's two moments
    and one 4-byte step count per tensor (23 tensors): 660,828 (what the run measures)."""
    cfg, dims, args = tiny_moe(**EP2_FSDP2)
    for rank in range(2):
        assert predict_rank(args, dims, cfg, rank) == {"weights": 330_368, "gradients": 330_368,
                                                       "optimizer": 2 * 330_368 + 4 * 23}
    # With ep 1, FSDP splits the experts' expert dimension like any first dimension: the same bytes.
    cfg, dims, args = tiny_moe(**{**EP2_FSDP2, "parallel.ep": 1})
    assert predict_rank(args, dims, cfg, 0)["weights"] == 330_368
    # Beside DDP (FSDP2 over (dp_replicate, 1)), everything but the experts is whole.
    cfg, dims, args = tiny_moe(**{"parallel.ep": 2, "parallel.zero_stage": 0, "parallel.dp_shard": 1,
                                  "parallel.dp_replicate": 2})
    assert predict_rank(args, dims, cfg, 1)["weights"] == (49_152 + 66_880) * 4


def test_tiny_moe_collectives_under_ep2_fsdp2():
    """By hand, per rank and step (2 micro-batches of 2 x 32 tokens, 2 MoE layers):
    - all-to-alls: 64 tokens x top-2 = 128 assignments of 64 fp32 (32,768 bytes) each way, forward
      and backward (4 x 32,768, the received rows at their uniform expectation, 128) and the 8
      int64 counts (64 bytes): 131,136 per layer and micro-batch, 524,544 per step;
    - FSDP over the other 66,880 elements (267,520 bytes): gathered twice per micro-batch but the
      embedding (81,920), the last block's 12,928 x 4 and the head (82,176) once, 319,232 per
      micro-batch; the gradients reduced once per micro-batch (gloo: all-reduce), and one fp32
      norm scalar per tensor of the rank, the experts' six included (the same group here);
    - the balance step once: 2 layers' counts (9 int64 each: 8 experts and the dropped) and losses
      (2 fp32 each), 2 x 80 = 160 bytes."""
    cfg, dims, args = tiny_moe(**EP2_FSDP2)
    predicted, exact = collectives(args, dims, cfg, 0)
    assert exact and predicted == {"dp_shard/all_gather_bytes": 2 * 319_232,
                                   "dp_shard/all_reduce_bytes": 2 * 267_520 + 4 * 23 + 160,
                                   "dp_shard/all_to_all_bytes": 524_544}


EP2_FSDP4 = {**EP2_FSDP2, "parallel.dp_shard": 4, "train.global_batch": 16}


def test_the_ranks_ep_leaves_shard_or_replicate_the_experts():
    """gridtrain.layout.experts by hand: ep takes the innermost of the dp x cp ranks; at ZeRO 2/3 the
    experts are sharded over what is left of dp_shard x cp, replicated over the rest; at ZeRO 0 whole."""
    from gridtrain.layout.experts import expert_split

    # (dp_replicate, dp_shard, cp, ep, zero) -> (edp_replicate, edp_shard)
    table = {(1, 4, 1, 2, 3): (1, 2), (1, 2, 2, 2, 3): (1, 2), (2, 2, 1, 2, 3): (2, 1), (2, 4, 1, 2, 2): (2, 2),
             (4, 1, 1, 2, 0): (2, 1), (1, 8, 1, 8, 3): (1, 1), (1, 64, 1, 8, 3): (1, 8), (1, 1, 1, 1, 3): (1, 1)}
    for degrees, split in table.items():
        assert expert_split(*degrees) == split, degrees


def test_tiny_moe_under_ep2_fsdp4():
    """By hand, 4 ranks: each rank's 4 experts of a layer (3 x 4 x 32 x 64 = 24,576 elements) are
    split in two on dimension 1 by FSDP over the 2 ranks ep leaves (12,288 a layer, 24,576 for
    both layers); the other 66,880 elements over dp_shard 4 (every first dimension divides by 4):
    16,720. Weights (24,576 + 16,720) x 4 = 165,184 bytes, AdamW's moments twice that and 23 step
    counts. Per step (2 micro-batches a rank): the all-to-alls as over 2 ranks (524,544) on 'ep';
    the experts' units gathered twice per micro-batch but the last layer's (2 x 196,608 - 98,304 =
    294,912) and reduced once (196,608) on 'edp_shard'; the dense units as over 2 ranks on
    'dp_shard', whose group, all 4 ranks, also carries the experts' 6 norm scalars and the balance
    step's 160 bytes."""
    cfg, dims, args = tiny_moe(**EP2_FSDP4)
    dims = parallel_dims(cfg, 4)
    for rank in range(4):
        assert predict_rank(args, dims, cfg, rank) == {"weights": 165_184, "gradients": 165_184,
                                                       "optimizer": 2 * 165_184 + 4 * 23}
    predicted, exact = collectives(args, dims, cfg, 0)
    assert exact and predicted == {"dp_shard/all_gather_bytes": 2 * 319_232,
                                   "dp_shard/all_reduce_bytes": 2 * 267_520 + 4 * 23 + 160,
                                   "ep/all_to_all_bytes": 524_544,
                                   "edp_shard/all_gather_bytes": 2 * 294_912,
                                   "edp_shard/all_reduce_bytes": 2 * 196_608}
    # At ZeRO 0 (DDP 4 beside EP 2) the experts are whole, their gradients all-reduced over the 2
    # copies every micro-batch, the dense weights' over all 4, and the norm scalars over 'ep'.
    cfg, _, _ = tiny_moe(**{"parallel.ep": 2, "parallel.zero_stage": 0, "parallel.dp_shard": 1,
                            "parallel.dp_replicate": 4, "train.global_batch": 16})
    dims = parallel_dims(cfg, 4)
    predicted, _ = collectives(args, dims, cfg, 0)
    assert predicted["edp_replicate/all_reduce_bytes"] == 2 * 196_608
    assert predicted["ep/all_reduce_bytes"] == 4 * 6
    assert predict_rank(args, dims, cfg, 0)["weights"] == (2 * 24_576 + 66_880) * 4


def test_recomputation_and_bf16_change_the_all_to_alls():
    """Recomputation runs the forward's three again; under bf16 the combine and its gradient move
    in 2 bytes (the dispatch carries the fp32 residual stream): per layer and micro-batch
    2 x 64 + (4 + 4 + 2) x 8,192 + (2 + 2 + 4) x 8,192 = 147,584 (128 rows of 64 = 8,192 elements)."""
    cfg, dims, args = tiny_moe(**EP2_FSDP2, **{"train.recompute": "full", "train.precision": "bf16"})
    assert all_to_all_bytes(args, dims, cfg, 2) == {"dp_shard/all_to_all_bytes": 4 * 147_584}
    # A given routing: rows received replace the expectation, and the ranks' sum stays the same.
    cfg, dims, args = tiny_moe(**EP2_FSDP2)
    more, fewer = (all_to_all_bytes(args, dims, cfg, 2, received=r)["dp_shard/all_to_all_bytes"] for r in (140, 116))
    assert more + fewer == 2 * 524_544 and more > 524_544


def test_the_expert_group_is_named_as_the_accounting_names_it():
    """'dp_cp' spans the world on 2 ranks (the first axis of the world's size names it), but is a
    group of its own beside a pipeline; on 4 ranks of HSDP it is the world's, named 'dp'."""
    named = [(2, {}, "dp_shard"),
             (2, {"parallel.dp_shard": 1, "parallel.dp_replicate": 2, "parallel.zero_stage": 0}, "dp_replicate"),
             (2, {"parallel.dp_shard": 1, "parallel.cp": 2}, "cp"), (4, {"parallel.pp": 2}, "dp_cp"),
             (4, {"parallel.dp_shard": 2, "parallel.dp_replicate": 2, "parallel.ep": 4}, "dp"),
             (4, {"parallel.dp_shard": 2, "parallel.cp": 2, "parallel.ep": 4}, "dp_shard_cp")]
    for world, keys, axis in named:
        cfg = load_config(None, {"model.preset": "tiny-moe", "parallel.ep": 2, **keys})
        assert ep_axis(parallel_dims(cfg, world)) == axis, keys


def test_balance_step_all_reduces():
    """Per MoE layer: E + 1 int64 counts and two fp32 losses (80 bytes for tiny-moe)."""
    cfg, dims, args = tiny_moe(**EP2_FSDP2)
    assert balance_collectives(args, dims, 2) == {"dp_shard/all_reduce_bytes": 2 * (9 * 8 + 8)}
