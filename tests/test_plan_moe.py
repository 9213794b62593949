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
