"""Hugging Face interchange of a mixture of experts: `gridtrain export` against transformers'
MixtralForCausalLM (Mixtral of Experts, Jiang et al. 2024), the state-dict mapping of the stacked
experts, `gridtrain import` of both layouts transformers loads and resuming from it, and the shapes
Mixtral cannot hold refused in one line before anything is written."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, MixtralForCausalLM

from gridtrain import tomlread
from gridtrain.cli import main
from gridtrain.config_load import load_config
from gridtrain.model import hf
from gridtrain.model.args import PRESETS, model_args
from gridtrain.train import hf_import, hf_run
from gridtrain.train.build import build_model, loss_fn
from gridtrain.train.trainer import Trainer

from conftest import tiny_overrides
from test_hf import Run  # a trained run: its config and final weights

CPU = torch.device("cpu")
SEQ = 256  # the tiny preset's whole context
# As in test_hf.py: three steps at a high learning rate move the weights (the routers' above all)
# far from the initialisation, so the experts a token picks depend on what it is.
TRAIN = {"train.steps": 3, "train.lr": 0.03, "checkpoint.interval": 1}
RUNS = {
    "moe": {},  # tiny-moe: 8 experts of width 32 on both layers, top-2, the aux loss; 4 heads, 2 KV heads
    # Heads of 32 beside dim 64 and 4 heads (MixtralConfig's head_dim), a tied head, Llama 3.1's RoPE.
    "wide_tied": {"model.head_dim": 32, "model.tie_embeddings": True, "model.rope_scaling": True},
    # DeepSeek-V3's balance with its bias never moved: the experts are chosen as Mixtral chooses them.
    "zero_bias": {"model.moe.balance": "bias", "model.moe.bias_update_rate": 0.0},
    "moved_bias": {"model.moe.balance": "bias"},  # the bias moved 3 times: refused
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_dir) -> dict[str, Run]:
    """Each model of RUNS (the tiny-moe preset) trained three steps, checkpointed after each."""
    root = tmp_path_factory.mktemp("hf-moe-runs")
    out = {}
    for name, extra in RUNS.items():
        items = tiny_overrides(root / name, corpus_dir) | TRAIN | {"model.preset": "tiny-moe"} | extra
        items["data.cache_dir"] = str(root / "cache")
        trainer = Trainer(load_config(None, items))
        trainer.run()
        weights = {k: v.detach().to(CPU, copy=True) for k, v in trainer.model.state_dict().items()}
        out[name] = Run(trainer.cfg, weights)
    return out


def token_ids() -> torch.Tensor:
    return torch.randint(0, 320, (2, SEQ), generator=torch.Generator().manual_seed(0))


def load_mixtral(path: Path) -> MixtralForCausalLM:
    model, info = MixtralForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------------------------------------
# Export -> transformers


@pytest.mark.parametrize("name", ["moe", "wide_tied", "zero_bias"])
def test_export_gives_mixtral_the_same_logits(runs, name, tmp_path):
    run = runs[name]
    out = hf_run.export_run(run.run_dir, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (8, 2, 32)
    assert config["sliding_window"] is None and config["output_router_logits"] is False
    assert config["router_aux_loss_coef"] == (0.01 if name != "zero_bias" else 0.0)
    model = load_mixtral(out)
    with torch.no_grad():
        got, want = model(token_ids()).logits, run.model()(token_ids())
    assert want.abs().max() > 1.0
    diff = max_diff(got, want)
    print(f"{name}: max |logit difference| {diff:.2e}")
    assert diff <= 1e-5
    stored = load_file(out / "model.safetensors")
    assert torch.equal(stored["model.layers.1.block_sparse_moe.experts.5.w2.weight"],
                       run.weights["layers.1.moe.experts.w2"][5])
    assert not any("expert_bias" in k or ".mlp." in k for k in stored)
    assert ("lm_head.weight" in stored) is (name != "wide_tied")


def test_parity_fails_with_gate_and_up_swapped(runs, tmp_path):
    """The parity check above can fail: each expert's w1 (gate, under the SiLU) and w3 (up)
    exchanged move the logits far."""
    run = runs["moe"]
    model = load_mixtral(hf_run.export_run(run.run_dir, tmp_path / "hf"))
    with torch.no_grad():
        for layer in model.model.layers:
            gate_up = layer.mlp.experts.gate_up_proj
            gate_up.copy_(torch.cat(gate_up.chunk(2, dim=1)[::-1], dim=1))
        assert max_diff(model(token_ids()).logits, run.model()(token_ids())) > 1e-2


def test_export_writes_what_save_pretrained_writes(runs, tmp_path):
    """transformers saves the loaded export under the same names, shapes and values (it stores
    Mixtral's experts one weight each even where it holds them fused)."""
    out = hf_run.export_run(runs["moe"].run_dir, tmp_path / "hf")
    load_mixtral(out).save_pretrained(tmp_path / "saved")
    ours, theirs = load_file(out / "model.safetensors"), load_file(tmp_path / "saved" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_state_dict_round_trip_is_exact_and_stores_each_expert_as_its_slice():
    args = model_args("tiny-moe")
    sd = build_model(args, 1, CPU).state_dict()
    hf_sd = hf.to_hf_state_dict(sd, args)
    assert len(hf_sd) == len(sd) + 2 * (3 * (8 - 1) - 1)  # per layer: w1, w2, w3 as 8 weights each, no bias
    assert torch.equal(hf_sd["model.layers.0.block_sparse_moe.experts.3.w1.weight"], sd["layers.0.moe.experts.w1"][3])
    assert hf_sd["model.layers.1.block_sparse_moe.gate.weight"] is sd["layers.1.moe.router.gate.weight"]
    back = hf.from_hf_state_dict(hf_sd, args)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    hf_sd["model.layers.0.block_sparse_moe.experts.8.w1.weight"] = hf_sd["model.layers.0.block_sparse_moe.gate.weight"]
    with pytest.raises(hf.InterchangeError, match=re.escape("experts.8.w1.weight")):
        hf.from_hf_state_dict(hf_sd, args)


# ---------------------------------------------------------------------------------------------
# Configs


def test_mixtral_configs_round_trip_through_transformers():
    for name in ("tiny-moe", "mixtral-8x7b"):
        args = PRESETS[name]()
        config = MixtralConfig(**hf.hf_config(args))
        assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == \
            (args.moe.num_experts, args.moe.top_k, args.moe.expert_ffn_dim)
        again = hf.args_from_hf_config(config.to_dict())
        assert again.moe == args.moe and hf.hf_config(again) == hf.hf_config(args)
        assert hf_import.pick_preset(again) == name


def test_the_hubs_mixtral_config_is_the_mixtral_preset():
    """mistralai/Mixtral-8x7B-v0.1's config.json (written by transformers 4.36) reads as the
    mixtral-8x7b preset, field for field, and imports onto it."""
    hub = {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
           "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
           "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
           "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
           "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
           "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000}
    assert hf.args_from_hf_config(hub) == PRESETS["mixtral-8x7b"]()
    assert hf_import.pick_preset(hf.args_from_hf_config(hub)) == "mixtral-8x7b"


@pytest.mark.parametrize("change, message", [
    ({"sliding_window": 128}, "sliding_window 128 below max_position_embeddings 256"),
    ({"model_type": "qwen3_moe"}, "model_type 'qwen3_moe': gridtrain reads 'llama' (LlamaForCausalLM) and 'mixtral'"),
    ({"num_experts_per_tok": 9}, "model.moe.top_k (9) is more than model.moe.num_experts (8)"),
    ({"num_experts_per_tok": 9}, "(in config.json, model.moe.top_k is num_experts_per_tok, model.moe.num_experts "
                                 "is num_local_experts)"),
    ({"num_local_experts": 8.0}, "num_local_experts = 8.0 is not a JSON integer"),
])
def test_unsupported_mixtral_configs_are_refused(change, message):
    cfg = hf.hf_config(PRESETS["tiny-moe"]()) | change
    with pytest.raises(hf.InterchangeError, match=re.escape(message)):
        hf.args_from_hf_config(cfg)


def test_a_window_as_long_as_the_context_is_whole_attention():
    cfg = hf.hf_config(PRESETS["tiny-moe"]()) | {"sliding_window": 256}
    assert hf.args_from_hf_config(cfg).moe == PRESETS["tiny-moe"]().moe


# ---------------------------------------------------------------------------------------------
# Import, then resume


def trainer_from_import(run_dir: Path, tmp: Path, corpus: Path, resume: bool) -> Trainer:
    items = {k: v for k, v in tiny_overrides(tmp, corpus).items() if not k.startswith(("model.", "run_dir"))}
    if not resume:
        items |= {"checkpoint.resume": False, "run_dir": str(tmp / "fresh")}
    return Trainer(load_config(run_dir / "imported.toml", items))


def test_import_then_resume_continues_the_original(runs, tmp_path, corpus_dir, capsys):
    """gridtrain -> Mixtral -> gridtrain gives the run's model back (its shape and every weight), the
    same loss on a batch, and a first step equal, bit for bit, to a fresh run given the original
    weights: the same loss, the same gradient (the aux loss's included), the same weights after."""
    run = runs["moe"]
    assert main(["export", str(run.run_dir), str(tmp_path / "hf")]) == 0
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    capsys.readouterr()
    toml = tomlread.loads((tmp_path / "imported" / "imported.toml").read_text())
    assert toml["model"]["preset"] == "tiny-moe" and toml["model"]["moe"]["aux_loss_coef"] == 0.01

    resumed = trainer_from_import(tmp_path / "imported", tmp_path, corpus_dir, resume=True)
    assert resumed.step == 0 and resumed.args == run.cfg.model.args()
    for key, value in resumed.model.state_dict().items():
        assert torch.equal(value.cpu(), run.weights[key]), key
    inputs, targets = resumed.data.train.read(0, resumed.global_batch)
    with torch.no_grad():
        original_loss = loss_fn(run.model()(inputs), targets).item()
    fresh = trainer_from_import(tmp_path / "imported", tmp_path, corpus_dir, resume=False)
    fresh.model.load_state_dict(run.weights)
    got, want = resumed.train_step(), fresh.train_step()
    assert got["loss/train"] == pytest.approx(original_loss, rel=1e-6)
    assert got["loss/train"] == want["loss/train"] and got["grad/norm"] == want["grad/norm"]
    for (key, a), b in zip(resumed.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(a, b), key
    assert any(not torch.equal(p.cpu(), run.weights[k]) for k, p in resumed.model.named_parameters())


@pytest.mark.parametrize("name", ["moe", "wide_tied"])
def test_import_reads_transformers_fused_layout(runs, name, tmp_path):
    """transformers 5's in-memory layout (`mlp.gate`, `mlp.experts.gate_up_proj`, `down_proj`), saved
    as it is, loads with from_pretrained and imports to the run's weights."""
    run = runs[name]
    out = hf_run.export_run(run.run_dir, tmp_path / "hf")
    model = load_mixtral(out)
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(out / "config.json", fused / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and run.cfg.model.args().tie_embeddings)}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    with torch.no_grad():
        assert max_diff(load_mixtral(fused)(token_ids()).logits, run.model()(token_ids())) <= 1e-5
    run_dir = hf_import.import_hf(fused, tmp_path / "imported")
    args = load_config(run_dir / "imported.toml").model.args()
    loaded = hf_run.load_model_weights(hf_run.open_checkpoint(run_dir / "checkpoints", args)[1], args)
    for key, value in loaded.items():
        want = torch.zeros_like(value) if key.endswith("expert_bias") else run.weights[key]
        assert torch.equal(value, want), key


@pytest.mark.parametrize("change, message", [
    ("missing", "model.layers.1.block_sparse_moe.experts.7.w2.weight is missing"),
    ("shape", "model.layers.0.block_sparse_moe.experts.2.w1.weight has shape [16, 64], the model [32, 64]"),
    ("extra", "model.layers.0.block_sparse_moe.experts.8.w3.weight is not in the model"),
])
def test_import_checks_every_expert_before_writing(runs, tmp_path, change, message):
    out = hf_run.export_run(runs["moe"].run_dir, tmp_path / "hf")
    weights = load_file(out / "model.safetensors")
    prefix = "model.layers.{}.block_sparse_moe.experts.{}.{}.weight"
    if change == "missing":
        del weights[prefix.format(1, 7, "w2")]
    elif change == "shape":
        weights[prefix.format(0, 2, "w1")] = weights[prefix.format(0, 2, "w1")][:16]
    else:
        weights[prefix.format(0, 8, "w3")] = weights[prefix.format(0, 7, "w3")].clone()
    save_file(weights, out / "model.safetensors")
    with pytest.raises(hf.InterchangeError, match=re.escape(message)):
        hf_import.import_hf(out, tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


# ---------------------------------------------------------------------------------------------
# What Mixtral cannot hold


@pytest.mark.parametrize("model, message", [
    ({"moe": {"score": "sigmoid"}}, "with sigmoid router scores, which transformers' Mixtral"),
    ({"moe": {"num_shared_experts": 1, "route_scale": 2.5}},
     "with gates scaled by route_scale 2.5 and 1 shared expert, which"),
    ({"moe": {"every": 2}}, "with dense layers (every 2, first_dense 0)"),
    ({"moe": {"capacity_factor": 1.25}}, "with tokens dropped past capacity_factor 1.25"),
    ({"moe": {"normalize_top_k": False}}, "with top-k gates not renormalised"),
    ({"qk_norm": True}, "with QK-norm"),
])
def test_shapes_mixtral_cannot_hold_are_refused_in_one_line(runs, tmp_path, capsys, model, message):
    """Refused from the run's config.json alone, before a checkpoint is looked for (this run has none)."""
    record = json.loads((runs["moe"].run_dir / "config.json").read_text())
    for key, value in model.items():
        if key == "moe":
            record["config"]["model"]["moe"] |= value
        else:
            record["config"]["model"][key] = value
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(record))
    assert main(["export", str(run_dir), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "gridtrain exports as MixtralForCausalLM those with" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_moved_expert_bias_is_refused_in_one_line(runs, tmp_path, capsys):
    run = runs["moved_bias"]
    assert any(v.any() for k, v in run.weights.items() if k.endswith("expert_bias"))
    assert main(["export", str(run.run_dir), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nonzero expert bias in 2 of 2 MoE layers" in err, err
    assert "balance 'aux_loss' or 'none' export" in err and not (tmp_path / "hf").exists()
    assert not any(v.any() for k, v in runs["zero_bias"].weights.items() if k.endswith("expert_bias"))
