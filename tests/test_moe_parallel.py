"""The mixture of experts under data and expert parallelism, against one process: the steps (losses,
clipped gradient norms, gathered weights), the validation loss, and the second leg (a stop-signal
checkpoint resumed under another layout or in one process for the last step), as the parity
matrix holds every layout (gridtrain/parity). With the expert bias, the bias of every layer is
one process's exactly: one differing count would flip a sign."""

from __future__ import annotations

import pytest
import torch

from gridtrain.parity.compare import deviation, problems, routing_of, tolerance
from gridtrain.parity.matrix import GLOBAL_BATCH, base_overrides
from gridtrain.parity.run import LEG, load_result, resume_in_one_process
from gridtrain.parity.sweep import LEG_OVERRIDES, VAL_BATCHES

pytestmark = pytest.mark.dist

FSDP2 = {"parallel.zero_stage": 3, "parallel.dp_shard": 2, "parallel.dp_replicate": 1}
DDP2 = {"parallel.zero_stage": 0, "parallel.dp_shard": 1, "parallel.dp_replicate": 2}
ZERO2 = {"parallel.zero_stage": 2, "parallel.dp_shard": 2, "parallel.dp_replicate": 1}
FSDP4 = {"parallel.zero_stage": 3, "parallel.dp_shard": 4, "parallel.dp_replicate": 1}
DDP4 = {"parallel.zero_stage": 0, "parallel.dp_shard": 1, "parallel.dp_replicate": 4}
HSDP4 = {"parallel.zero_stage": 3, "parallel.dp_shard": 2, "parallel.dp_replicate": 2}
EP2, EP4, EP1 = {"parallel.ep": 2}, {"parallel.ep": 4}, {"parallel.ep": 1}
TP2, CP2 = {"parallel.tp": 2}, {"parallel.cp": 2, "parallel.zero_stage": 3}
PP2 = {s: {"parallel.pp": 2, "parallel.pp_schedule": s, "parallel.pp_virtual_stages": 1 if s in ("gpipe", "1f1b") else 2}
       for s in ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv")}
BIAS = {"model.moe.balance": "bias", "model.moe.bias_update_rate": 0.01}
# Two experts, one per rank, top-1, and a bias step of 10: after the first step every token goes to
# the expert that was less loaded, so the other rank receives no token at all.
FORCED = {"model.moe.num_experts": 2, "model.moe.top_k": 1, "model.moe.normalize_top_k": False,
          "model.moe.balance": "bias", "model.moe.bias_update_rate": 10.0}

WORLD2: dict[str, tuple[dict, dict | None]] = {
    # name: (layout and model keys, the layout its checkpoint resumes under; None: one process)
    "ep2.fsdp": ({**FSDP2, **EP2}, {**DDP2, **EP1}),
    "ep2.ddp": ({**DDP2, **EP2}, None),
    "ep2.zero2": ({**ZERO2, **EP2}, {**FSDP2, **EP2}),
    "ep1.fsdp": ({**FSDP2, **EP1}, {**DDP2, **EP2}),
    "ep1.ddp": ({**DDP2, **EP1}, None),
    "ep2.fsdp.bias": ({**FSDP2, **EP2, **BIAS}, {**DDP2, **EP2}),
    "ep2.fsdp.forced": ({**FSDP2, **EP2, **FORCED}, None),
    "ep2.fsdp.full.bf16": ({**FSDP2, **EP2, "train.recompute": "full", "train.precision": "bf16"}, None),
    "ep2.capacity": ({**FSDP2, **EP2, "model.moe.capacity_factor": 1.0}, None),
    "ep2.fsdp.fp16.selective": ({**FSDP2, **EP2, "train.precision": "fp16", "train.recompute": "selective"}, None),
    "ep1.fsdp.fp16": ({**FSDP2, **EP1, "train.precision": "fp16"}, None),
    "ep2.ddp.zloss.sigmoid": ({**DDP2, **EP2, "model.moe.z_loss_coef": 1e-3, "model.moe.score": "sigmoid",
                               "model.moe.num_shared_experts": 1}, {**FSDP2, **EP1}),
    # A pipeline's first step probes each stage's shapes with a forward, on uninitialised tensors after
    # the first stage: counted, it moved the bias by a micro-batch that never was (SplitBackwardStage).
    "pp2.gpipe.bias": ({**PP2["gpipe"], "parallel.dp_shard": 1, **BIAS}, {**PP2["1f1b"], "parallel.dp_shard": 1}),
    "pp2.zbv.full": ({**PP2["zbv"], "parallel.dp_shard": 1, "train.recompute": "full"}, None),
    "tp2": ({**TP2, "parallel.dp_shard": 1, **BIAS}, {**TP2, "parallel.sequence_parallel": True, "parallel.dp_shard": 1}),
    "tp2.sp.selective": ({**TP2, "parallel.sequence_parallel": True, "parallel.dp_shard": 1,
                          "train.recompute": "selective"}, None),
    "cp2": ({**CP2, "parallel.dp_shard": 1}, {**CP2, "parallel.dp_shard": 1, **EP2}),
    "cp2.ep2.bias": ({**CP2, "parallel.dp_shard": 1, **EP2, **BIAS, "model.moe.z_loss_coef": 1e-3}, None),
}
WORLD4: dict[str, tuple[dict, dict | None]] = {
    "ep4.fsdp": ({**FSDP4, **EP4}, {**HSDP4, **EP4}),
    "ep4.hsdp.bias": ({**HSDP4, **EP4, **BIAS}, None),
    "ep2.pp2.1f1b": ({**FSDP2, **EP2, **PP2["1f1b"]}, {**DDP2, **EP2, **PP2["interleaved-1f1b"]}),
    "ep2.pp2.interleaved-zb.bias": ({**DDP2, **EP2, **PP2["interleaved-zb"], **BIAS}, None),
    "ep2.tp2.sp": ({**FSDP2, **EP2, **TP2, "parallel.sequence_parallel": True}, {**FSDP2, **EP1, **TP2}),
    "ep4.cp2.fsdp": ({**FSDP2, **CP2, **EP4, "model.moe.z_loss_coef": 1e-3}, None),
    # ep below dp x cp: the experts FSDP-sharded over the data-parallel ranks left (gridtrain.layout.experts),
    # resumed where ep spans every rank, and in one process
    "ep2.fsdp4": ({**FSDP4, **EP2}, {**FSDP4, **EP4}),
    "ep2.fsdp4.bias": ({**FSDP4, **EP2, **BIAS}, None),
    "ep2.cp2.fsdp.bias": ({**FSDP2, **CP2, **EP2, **BIAS}, {**DDP4, **EP2}),  # the experts' copies all-reduced
    "ep2.ddp4.bias": ({**DDP4, **EP2, **BIAS}, {**HSDP4, **EP2}),  # DDP beside EP: 2 whole copies, all-reduced
}
WORLD8: dict[str, tuple[dict, dict | None]] = {
    # ep below dp x cp beside tensor parallelism (the experts whole on each TP rank) and beside a
    # pipeline: each stage's experts FSDP-sharded over the 2 data-parallel ranks ep leaves
    "ep2.fsdp4.tp2": ({**FSDP4, **EP2, **TP2}, None),
    "ep2.fsdp4.pp2.1f1b.bias": ({**FSDP4, **EP2, **PP2["1f1b"], **BIAS}, None),
    # the experts on a 3-D mesh: ep 2 of HSDP 2 x 2 x CP 2, FSDP-sharded over the 2 ranks left of
    # dp_shard x cp and replicated over dp_replicate's 2 (edp_replicate 2 x edp_shard 2 x ep 2)
    "ep2.hsdp4.cp2.bias": ({**HSDP4, **CP2, **EP2, **BIAS}, None),
}
MODEL_KEYS = ("model.", "train.precision", "train.recompute")


def overrides(work, corpus, keys: dict, micro_batch: int) -> dict:
    return {**base_overrides(), "model.preset": "tiny-moe", "data.corpus": str(corpus),
            "data.cache_dir": str(work / "data-cache"), "train.micro_batch": micro_batch, **LEG_OVERRIDES, **keys}


def _spec(work, corpus, world: int, cases: dict, ranks_per_batch: int = 1) -> dict:
    micro = GLOBAL_BATCH * ranks_per_batch // world // 2  # two micro-batches per rank: accumulation everywhere
    return {name: {**overrides(work, corpus, keys, micro), LEG: resume} for name, (keys, resume) in cases.items()}


def launch_cases(work, corpus) -> dict[int, dict]:
    """Both worlds' cases, in the launches the test modules share (tests/launches.py)."""
    return {2: _spec(work, corpus, 2, WORLD2), 4: _spec(work, corpus, 4, WORLD4),
            8: _spec(work, corpus, 8, WORLD8, ranks_per_batch=2)}  # dp 4: tp or pp takes the other 2


def launched_world(launches, tmp_path_factory, corpus_dir, world: int, cases: dict) -> dict:
    from gridtrain.parity.run import run_reference

    out, work = launches.out(__name__, world), tmp_path_factory.mktemp(f"moe{world}")
    spec = launches.cases()[__name__][world]
    results = {}
    for name, (keys, _) in cases.items():
        one = {k: v for k, v in keys.items() if k.startswith(MODEL_KEYS)}
        micro = spec[name]["train.micro_batch"]
        ref = run_reference({**overrides(work / "ref" / name, corpus_dir, one, micro),
                             "run_dir": str(work / "ref" / name / "run")}, leg=True)
        run = load_result(out, name)
        if run is not None and run.leg is None:
            run.leg = resume_in_one_process(run, spec[name])
        results[name] = (run, ref, spec[name])
    return results


@pytest.fixture(scope="module")
def world2(launches, tmp_path_factory, corpus_dir):
    return launched_world(launches, tmp_path_factory, corpus_dir, 2, WORLD2)


@pytest.fixture(scope="module")
def world4(launches, tmp_path_factory, corpus_dir):
    return launched_world(launches, tmp_path_factory, corpus_dir, 4, WORLD4)


@pytest.fixture(scope="module")
def world8(launches, tmp_path_factory, corpus_dir):
    return launched_world(launches, tmp_path_factory, corpus_dir, 8, WORLD8)


def verdict(run, ref, spec) -> list[str]:
    """Everything that differs from one process beyond the parity module's bounds."""
    precision, tokens, routing = spec.get("train.precision", "fp32"), GLOBAL_BATCH * 32, routing_of(spec)
    found = problems(deviation(run, ref), tolerance(precision, tokens, ref.lrs, 0.9, 0.95, routing))
    found += [f"resumed: {p}" for p in problems(deviation(run.leg, ref.leg), tolerance(precision, tokens, ref.leg.lrs,
                                                                                         0.9, 0.95, routing))]
    val_tol = tolerance(precision, VAL_BATCHES * spec["train.micro_batch"] * 32, ref.lrs, 0.9, 0.95).loss_rtol
    if not abs(run.val_loss - ref.val_loss) <= val_tol * ref.val_loss:
        found.append(f"validation loss {run.val_loss} vs {ref.val_loss}")
    return found


@pytest.mark.parametrize("name", list(WORLD2))
def test_moe_layouts_over_two_ranks_train_resume_and_validate_as_one_process(world2, name):
    run, ref, spec = world2[name]
    assert run is not None and len(run.losses) == LEG_OVERRIDES["train.steps"] - 1
    assert verdict(run, ref, spec) == []
    _same_biases(run, ref, name)
    if name.startswith("pp2"):  # the metrics are the whole model's on every stage (rank 0 holds the first)
        import json

        record = json.loads((run.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        assert {f"moe/load/layer{i}" for i in range(4)} <= set(record), sorted(record)


@pytest.mark.usefixtures("launches")  # the fixture is asked for by name below: the shared launches must know
@pytest.mark.parametrize("world, name", [(4, name) for name in WORLD4] + [(8, name) for name in WORLD8])
def test_moe_layouts_over_four_and_eight_ranks_train_resume_and_validate_as_one_process(request, world, name):
    run, ref, spec = request.getfixturevalue(f"world{world}")[name]
    assert run is not None
    assert verdict(run, ref, spec) == []
    _same_biases(run, ref, name)


def _same_biases(run, ref, name: str) -> None:
    biases = [k for k in ref.weights if k.endswith("expert_bias")]
    assert biases and all(k in run.weights for k in biases)
    for key in biases:
        assert torch.equal(run.weights[key], ref.weights[key]), key
        assert torch.equal(run.leg.weights[key], ref.leg.weights[key]), key
    if "bias" in name or "forced" in name:
        assert any(ref.leg.weights[k].abs().sum() > 0 for k in biases)  # it moved, and alike


def test_the_forced_case_leaves_an_expert_and_its_rank_without_tokens(tmp_path, make_config):
    """In one process, as the forced case's ranks see it: after step 1 every layer's bias is +10 on
    one expert and -10 on the other, so at step 2 every token goes to one expert, and under EP 2
    the other expert's rank receives no row."""
    from gridtrain.model.moe import moe_layers
    from gridtrain.train.trainer import Trainer

    trainer = Trainer(make_config(tmp_path, **{"model.preset": "tiny-moe", **FORCED}))
    trainer.train_step()
    layers = moe_layers(trainer.model)
    for _, layer in layers:
        assert sorted(layer.expert_bias.tolist()) == [-10.0, 10.0]
    seen = []
    hooks = [layer.experts.register_forward_hook(lambda m, args, out: seen.append(args[1].tolist()))
             for _, layer in layers]
    trainer.train_step()
    for hook in hooks:
        hook.remove()
    assert seen and all(0 in counts for counts in seen), seen  # rows per expert, each micro-batch and layer
    trainer.release()
