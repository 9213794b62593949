"""The mixture-of-experts model on one process: routing, experts, balance, capacity, and training
through the trainer (accumulation, recomputation, checkpoints)."""

import dataclasses

import pytest
import torch

from gridtrain.model import moe as moe_module
from gridtrain.model.args import PRESETS, model_args
from gridtrain.model.moe import Router, aux_loss, dispatch_order, moe_layers, prob_sums
from gridtrain.model.moe_args import MoEArgs
from gridtrain.model.stats import build_meta, count_parameters, model_parameters
from gridtrain.train.balance import balance_step, set_loss_scale
from gridtrain.train.build import build_model, loss_fn
from gridtrain.train.trainer import Trainer

CPU = torch.device("cpu")


def tiny_moe(**moe: object):
    args = PRESETS["tiny-moe"]()
    return dataclasses.replace(args, moe=dataclasses.replace(args.moe, **moe))


def grads_of(args, tokens: torch.Tensor, dtype: torch.dtype | None = None):
    model = build_model(args, 0, CPU)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        logits = model(tokens)
    loss = loss_fn(logits, tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model


# ---------------------------------------------------------------------------------------------
# Experts: torch._grouped_mm and the loop give the same numbers


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_grouped_mm_and_the_expert_loop_agree_bit_for_bit(dtype):
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    loss_g, grads_g, _ = grads_of(tiny_moe(grouped_mm=True), tokens, dtype)
    loss_l, grads_l, _ = grads_of(tiny_moe(grouped_mm=False), tokens, dtype)
    assert torch.equal(loss_g, loss_l)
    assert grads_g.keys() == grads_l.keys()
    for name in grads_g:
        assert torch.equal(grads_g[name], grads_l[name]), name


def test_an_expert_without_tokens_runs_and_gets_a_zero_gradient():
    x = torch.randn(6, 16)
    w1, w3 = torch.randn(4, 8, 16, requires_grad=True), torch.randn(4, 8, 16, requires_grad=True)
    w2 = torch.randn(4, 16, 8, requires_grad=True)
    counts = torch.tensor([2, 0, 4, 0])
    out = {}
    for grouped in (True, False):
        for w in (w1, w2, w3):
            w.grad = None
        y = moe_module.experts_forward(x, counts, w1, w2, w3, grouped)
        y.sum().backward()  # a stride-0 gradient, which torch._grouped_mm's backward refuses alone
        out[grouped] = (y.detach(), w1.grad.clone(), w2.grad.clone())
    assert all(torch.equal(a, b) for a, b in zip(out[True], out[False]))
    assert torch.count_nonzero(out[True][1][1]) == 0 and torch.count_nonzero(out[True][1][0]) > 0
    # Expert 2's rows are rows 2..5 of x, through expert 2's weights alone.
    e = 2
    expected = (torch.nn.functional.silu(x[2:] @ w1[e].T) * (x[2:] @ w3[e].T)) @ w2[e].T
    torch.testing.assert_close(out[True][0][2:], expected.detach())


# ---------------------------------------------------------------------------------------------
# The router


def test_gates_are_the_scores_of_the_chosen_experts_renormalised_and_scaled():
    args = MoEArgs(num_experts=4, top_k=2, expert_ffn_dim=8, route_scale=2.5)
    router = Router(8, args)
    x = torch.randn(5, 8)
    logits, scores, gates, experts = router(x, None)
    expected = torch.softmax(x @ router.gate.weight.T, dim=-1)
    torch.testing.assert_close(scores, expected)
    top = expected.topk(2, dim=-1)
    assert torch.equal(experts, top.indices)
    torch.testing.assert_close(gates, 2.5 * top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(gates.sum(-1), torch.full((5,), 2.5))


def test_the_expert_bias_chooses_the_experts_but_never_changes_the_gate_values():
    args = MoEArgs(num_experts=4, top_k=2, expert_ffn_dim=8, score="sigmoid", balance="bias")
    router = Router(8, args)
    x = torch.randn(6, 8)
    _, scores, _, plain = router(x, None)
    bias = torch.tensor([0.0, 0.0, 5.0, 5.0])  # experts 2 and 3 win every choice
    _, _, gates, chosen = router(x, bias)
    assert sorted(chosen.flatten().tolist()) == [2] * 6 + [3] * 6
    picked = scores.gather(-1, chosen)
    torch.testing.assert_close(gates, picked / picked.sum(-1, keepdim=True))
    assert not torch.equal(plain.sort(-1).values, chosen.sort(-1).values)


def test_the_router_scores_in_fp32_under_bf16_autocast():
    router = Router(8, MoEArgs(num_experts=4, top_k=1, expert_ffn_dim=8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, scores, gates, _ = router(torch.randn(3, 8), None)
    assert logits.dtype == scores.dtype == gates.dtype == torch.float32


def test_the_aux_loss_is_alpha_when_balanced_and_follows_switch_by_hand():
    args = MoEArgs(num_experts=2, top_k=1, expert_ffn_dim=8, aux_loss_coef=0.1)
    balanced = aux_loss(prob_sums(torch.tensor([[0.5, 0.5], [0.5, 0.5]]), args), torch.tensor([1, 1]), 2, args)
    assert balanced.item() == pytest.approx(0.1)
    # Both tokens to expert 0 with scores (0.75, 0.25): f = (1, 0), P = (0.75, 0.25);
    # alpha E sum f P = 0.1 x 2 x 0.75 = 0.15.
    skewed = aux_loss(prob_sums(torch.tensor([[0.75, 0.25], [0.75, 0.25]]), args), torch.tensor([2, 0]), 2, args)
    assert skewed.item() == pytest.approx(0.15)
    # Sigmoid scores are normalised per token first: (0.9, 0.3) reads as (0.75, 0.25).
    sigmoid = dataclasses.replace(args, score="sigmoid")
    assert aux_loss(prob_sums(torch.tensor([[0.9, 0.3], [0.9, 0.3]]), sigmoid), torch.tensor([2, 0]), 2,
                    sigmoid).item() == pytest.approx(0.15)


def test_capacity_keeps_each_experts_first_assignments_in_token_order():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # 4 tokens, k = 2
    order, counts = dispatch_order(experts, 4, capacity=2)
    flat = experts.flatten()
    # Expert 0 was chosen by tokens 0, 1, 2, 3 (assignments 0, 2, 4, 7): it keeps 0 and 2.
    assert order.tolist() == [0, 2, 1, 5, 3, 6]
    assert counts.tolist() == [2, 2, 1, 1]
    assert flat[order].tolist() == [0, 0, 1, 1, 2, 3]
    assert MoEArgs(num_experts=8, top_k=2, capacity_factor=1.0).capacity(32) == 8
    assert MoEArgs(num_experts=4, top_k=1, capacity_factor=1.1).capacity(50) == 14  # ceil(13.75)


# ---------------------------------------------------------------------------------------------
# Balance losses reach the gradient as if added to the loss


def test_the_attached_balance_losses_give_the_gradient_of_loss_plus_scaled_balance(monkeypatch):
    args = tiny_moe(z_loss_coef=1e-3, aux_loss_coef=0.05)
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(2))
    scale = 0.25
    model = build_model(args, 0, CPU)
    set_loss_scale([model], scale)
    (loss_fn(model(tokens), tokens) * scale).backward()
    attached = {n: p.grad.clone() for n, p in model.named_parameters()}

    collected = []
    monkeypatch.setattr(moe_module._AttachLoss, "apply", lambda out, loss, s: collected.append(loss) or out)
    reference = build_model(args, 0, CPU)
    loss = loss_fn(reference(tokens), tokens)
    assert len(collected) == 2  # one per MoE layer: aux + z
    ((loss + sum(collected)) * scale).backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(attached[name], p.grad, rtol=1e-6, atol=1e-9, msg=name)
    router = "layers.0.moe.router.gate.weight"
    assert not torch.allclose(attached[router], _lm_only_grad(args, tokens, scale)[router])


def _lm_only_grad(args, tokens, scale):
    plain = dataclasses.replace(args, moe=dataclasses.replace(args.moe, balance="none", z_loss_coef=0.0))
    model = build_model(plain, 0, CPU)
    (loss_fn(model(tokens), tokens) * scale).backward()
    return {n: p.grad for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# Counting, the bias and the step's metrics


def test_the_bias_moves_once_by_the_sum_of_every_micro_batchs_counts():
    args = tiny_moe(balance="bias", bias_update_rate=0.01)
    model = build_model(args, 0, CPU)
    batches = [torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    expected = {name: torch.zeros(8, dtype=torch.long) for name, _ in moe_layers(model)}
    for tokens in batches:
        for name, layer in moe_layers(model):  # each layer's counts of this micro-batch, seen alone
            layer.register_forward_hook(_count_into(expected[name]))
        loss_fn(model(tokens), tokens).backward()
        for _, layer in moe_layers(model):
            layer._forward_hooks.clear()
    metrics = balance_step([model], [], shares=4, stepped=True, n_layers=2)
    for name, layer in moe_layers(model):
        load = expected[name].double()
        assert torch.equal(layer.expert_bias, (0.01 * torch.sign(load.mean() - load)).float())
        assert metrics[f"moe/load/layer{name.split('.')[1]}"] == pytest.approx(
            float(load.max() / load.mean()))
        assert int(layer.tokens_per_expert.sum()) == 0  # zeroed for the next step
    assert set(layer.expert_bias.abs().unique().tolist()) <= {0.0, torch.tensor(0.01).item()}


def _count_into(total: torch.Tensor):
    def hook(module, inputs, output):
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        _, _, _, experts = module.router(x, module.expert_bias if module.args.balance == "bias" else None)
        total.add_(torch.bincount(experts.flatten(), minlength=module.args.num_experts))
    return hook


def test_a_recomputed_block_is_counted_once_and_trains_as_without_recomputation():
    from gridtrain.parallel.parallelize import apply_recompute

    args = tiny_moe(z_loss_coef=1e-3)
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(3))
    results = {}
    for mode in ("none", "selective", "full"):
        model = build_model(args, 0, CPU)
        if mode != "none":
            apply_recompute(model, mode)
        loss_fn(model(tokens), tokens).backward()
        counts = torch.stack([layer.tokens_per_expert.clone() for _, layer in moe_layers(model)])
        losses = torch.stack([layer.balance_losses.clone() for _, layer in moe_layers(model)])
        results[mode] = (counts, losses, {n.replace("._checkpoint_wrapped_module", ""): p.grad
                                          for n, p in model.named_parameters()})
    assert int(results["none"][0].sum()) == 2 * 2 * 16 * 2  # layers x tokens x k
    for mode in ("selective", "full"):
        assert torch.equal(results[mode][0], results["none"][0]), mode
        assert torch.equal(results[mode][1], results["none"][1]), mode
        for name, grad in results["none"][2].items():
            torch.testing.assert_close(results[mode][2][name], grad, rtol=0, atol=0, msg=f"{mode} {name}")


def test_validation_and_sampling_do_not_count():
    model = build_model(PRESETS["tiny-moe"](), 0, CPU)
    with torch.no_grad():
        model(torch.randint(0, 320, (2, 8)))
    assert all(int(layer.tokens_per_expert.sum()) == 0 for _, layer in moe_layers(model))


# ---------------------------------------------------------------------------------------------
# Through the trainer


def moe_config(make_config, path, **overrides):
    return make_config(path, **{"model.preset": "tiny-moe", **overrides})


def test_capacity_one_with_every_token_forced_to_two_experts_drops_the_arithmetic(tmp_path, make_config):
    cfg = moe_config(make_config, tmp_path, **{"model.moe.capacity_factor": 1.0, "model.moe.balance": "bias",
                                               "model.moe.bias_update_rate": 0.0, "train.steps": 3})
    trainer = Trainer(cfg)
    for _, layer in moe_layers(trainer.model):
        layer.expert_bias.copy_(torch.tensor([0, 0, 0, 50.0, 0, 50.0, 0, 0]))  # experts 3 and 5 win
    for _ in range(3):
        metrics = trainer.train_step()
        # A micro-batch of 2 x 32 tokens sends 64 to each of experts 3 and 5; each keeps
        # ceil(1.0 x 64 x 2 / 8) = 16: 96 of the 128 assignments are dropped.
        assert metrics["moe/dropped_frac"] == 96 / 128
        assert metrics["moe/load_max"] == 4.0  # 64 of a mean of 16 per expert, counted before dropping
        assert torch.isfinite(torch.tensor(metrics["loss/train"]))


def test_capacity_binds_in_training_only_so_a_tokens_output_does_not_depend_on_its_company():
    # Under a capacity a forward of N tokens keeps ceil(c N k / E) assignments an expert; applied in
    # eval mode, a prefix's logits and a cached decode's (one token a step: nothing ever dropped)
    # differed from the whole sequence's forward by up to 3.6e-4 here.
    from gridtrain.model.generate import KVCache, forward_cached

    model = build_model(tiny_moe(capacity_factor=1.0), 0, CPU)
    tokens = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(3))
    model.train()
    with torch.no_grad():  # the training forward still drops: the layers' inputs differ
        assert not torch.equal(model(tokens), build_model(tiny_moe(), 0, CPU).train()(tokens))
    model.eval()
    with torch.no_grad():
        whole = model(tokens)
        assert torch.equal(whole, build_model(tiny_moe(), 0, CPU).eval()(tokens))  # eval routes dropless
        torch.testing.assert_close(model(tokens[:, :8]), whole[:, :8], rtol=0, atol=1e-6)
        cache = KVCache(model, 1, 24)
        steps = [forward_cached(model, tokens[:, :8], cache)]
        steps += [forward_cached(model, tokens[:, t:t + 1], cache) for t in range(8, 24)]
        torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=1e-5)


def test_the_bias_is_updated_once_per_step_under_accumulation(tmp_path, make_config):
    cfg = moe_config(make_config, tmp_path, **{"model.moe.balance": "bias", "model.moe.bias_update_rate": 0.125,
                                               "train.global_batch": 8, "train.micro_batch": 2, "train.steps": 1})
    trainer = Trainer(cfg)
    assert trainer.accum == 4
    trainer.train_step()
    for _, layer in moe_layers(trainer.model):
        assert set(layer.expert_bias.abs().unique().tolist()) <= {0.0, 0.125}
        assert layer.expert_bias.abs().sum() > 0


def test_an_moe_run_resumes_bit_for_bit_with_its_expert_bias(tmp_path, make_config):
    common = {"model.moe.balance": "bias", "model.moe.z_loss_coef": 1e-3, "train.steps": 6,
              "checkpoint.interval": 3}
    whole = Trainer(moe_config(make_config, tmp_path / "a", **common))
    losses = [whole.train_step()["loss/train"] for _ in range(6)]
    first = Trainer(moe_config(make_config, tmp_path / "b", **common))
    first.run_steps = [first.train_step()["loss/train"] for _ in range(3)]
    first.save()
    first.release()
    second = Trainer(moe_config(make_config, tmp_path / "b", **common, **{"checkpoint.resume": True}))
    assert second.step == 3
    bias = {n: layer.expert_bias.clone() for n, layer in moe_layers(second.model)}
    assert any(b.abs().sum() > 0 for b in bias.values())
    resumed = [second.train_step()["loss/train"] for _ in range(3)]
    assert first.run_steps + resumed == losses
    for (name, a), (_, b) in zip(moe_layers(whole.model), moe_layers(second.model)):
        assert torch.equal(a.expert_bias, b.expert_bias), name
    whole.release()
    second.release()


# ---------------------------------------------------------------------------------------------
# Parameter counts


@pytest.mark.parametrize("preset,total,active", [
    ("mixtral-8x7b", 46.7e9, 12.9e9),  # Jiang et al. 2024
    ("qwen3-235b-a22b", 235e9, 22e9),  # Qwen3 technical report
    ("qwen3-30b-a3b", 30.5e9, 3.35e9),  # its model card: 30.5B, "3.3B activated" (3.35B, rounded down)
])
def test_presets_have_their_published_total_and_active_parameters(preset, total, active):
    counts = model_parameters(PRESETS[preset]())
    assert counts.total == pytest.approx(total, rel=0.01)
    assert counts.active == pytest.approx(active, rel=0.01)


def test_counting_by_kind_of_block_equals_building_every_block():
    args = model_args("tiny-moe", moe={"first_dense": 1, "every": 2, "num_shared_experts": 1}, n_layers=6)
    assert [args.moe.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    assert model_parameters(args) == count_parameters(build_meta(args))
    dense = count_parameters(build_meta(dataclasses.replace(args, moe=None)))
    counts = model_parameters(args)
    # Three MoE blocks replace three dense MLPs (3 x 64 x 160) by a router (8 x 64), 8 experts of
    # 3 x 64 x 32 and one shared expert of the same width.
    assert counts.total - dense.total == 3 * (8 * 64 + 8 * 3 * 64 * 32 + 3 * 64 * 32 - 3 * 64 * 160)
    assert counts.experts == 3 * 8 * 3 * 64 * 32 and counts.experts_active == 3 * 2 * 3 * 64 * 32


def test_qk_norm_and_a_wider_head_train_and_count():
    args = dataclasses.replace(PRESETS["tiny-moe"](), explicit_head_dim=32, qk_norm=True)
    model = build_model(args, 0, CPU)
    assert model.layers["0"].attention.wq.weight.shape == (4 * 32, 64)
    assert model.layers["0"].attention.q_norm.weight.shape == (32,)
    tokens = torch.randint(0, 320, (1, 8))
    loss_fn(model(tokens), tokens).backward()
    assert model_parameters(args) == count_parameters(build_meta(args))


def test_a_choice_named_none_is_that_choice_not_the_presets():
    """`--model.moe.balance none` turns balancing off; it is not the 'keep the preset's' of other keys."""
    from gridtrain.config_load import load_config

    assert load_config(None, {"model.preset": "tiny-moe", "model.moe.balance": "none"}).model.args().moe.balance == "none"
    assert load_config(None, {"model.preset": "tiny-moe"}).model.args().moe.balance == "aux_loss"
    assert load_config(None, {"model.preset": "tiny-moe", "model.moe.score": "sigmoid"}).model.args().moe.score == "sigmoid"


def test_a_skipped_step_leaves_the_expert_bias_alone():
    """The guard or fp16's scaler skipped the update: the bias does not move either, and the step's
    counts are still zeroed."""
    model = build_model(tiny_moe(balance="bias"), 0, CPU)
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(5))
    loss_fn(model(tokens), tokens).backward()
    balance_step([model], [], shares=1, stepped=False, n_layers=2)
    for _, layer in moe_layers(model):
        assert torch.count_nonzero(layer.expert_bias) == 0 and int(layer.tokens_per_expert.sum()) == 0


def test_top_1_renormalised_is_refused_and_capacity_past_every_assignment_is_dropless():
    assert "never trains the router" in " ".join(MoEArgs(top_k=1).problems(64, 2))
    assert MoEArgs(top_k=1, normalize_top_k=False).problems(64, 2) == []
    assert MoEArgs(num_experts=8, top_k=2, capacity_factor=4.0).capacity(32) is None  # 4 x 2 >= 8
    assert MoEArgs(num_experts=8, top_k=2, capacity_factor=1e300).capacity(32) is None
