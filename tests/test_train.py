import json
import math
import shutil

import pytest
import torch
from torch import nn

from gridtrain.cli import main
from gridtrain.config import TrainConfig
from gridtrain.model.args import model_args
from gridtrain.parallel.parallelize import apply_recompute
from gridtrain.checkpoint import store as checkpoint
from gridtrain.train.metrics import MetricsWriter, format_line, read_metrics
from gridtrain.train.optim import lr_at
from gridtrain.train.precision import Precision
from gridtrain.train.build import build_model, loss_fn
from gridtrain.train.trainer import Trainer

from conftest import FAKE_PEAK_FLOPS

CPU = torch.device("cpu")


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def jsonl(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# Gradient accumulation


def _capture_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Record the accumulated gradients when the trainer unscales them (before clipping)."""
    grads: dict[str, torch.Tensor] = {}
    unscale = trainer.precision.unscale_

    def capture(optimizer, group=None):
        unscale(optimizer, group)
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})

    trainer.precision.unscale_ = capture
    return grads


def test_accumulated_step_equals_one_big_batch(tmp_path, make_config):
    small = Trainer(make_config(tmp_path / "a", **{"train.global_batch": 8, "train.micro_batch": 2}))
    big = Trainer(make_config(tmp_path / "b", **{"train.global_batch": 8, "train.micro_batch": 8}))
    assert (small.accum, big.accum) == (4, 1)
    before = params(small.model)
    grads_small, grads_big = _capture_grads(small), _capture_grads(big)
    m_small, m_big = small.train_step(), big.train_step()

    assert m_small["loss/train"] == pytest.approx(m_big["loss/train"], rel=1e-6)
    assert m_small["grad/norm"] == pytest.approx(m_big["grad/norm"], rel=1e-5)
    assert grads_small.keys() == grads_big.keys() and grads_small
    for name in grads_small:
        torch.testing.assert_close(grads_small[name], grads_big[name], rtol=1e-5, atol=1e-7)
    for (name, p_small), p_big in zip(small.model.named_parameters(), big.model.parameters()):
        torch.testing.assert_close(p_small, p_big, rtol=1e-5, atol=1e-5)
    assert any(not torch.equal(before[n], p) for n, p in small.model.named_parameters())


def test_accumulated_gradient_is_the_mean_over_the_global_batch(tmp_path, make_config):
    """The trainer's gradient equals the gradient of the mean loss over samples [0, 8) (the
    reference on the trainer's device: the CPU, or the accelerator it picked)."""
    trainer = Trainer(make_config(tmp_path, **{"train.global_batch": 8, "train.micro_batch": 2}))
    reference = build_model(trainer.args, trainer.cfg.train.seed, trainer.device)
    inputs, targets = (t.to(trainer.device) for t in trainer.data.train.read(0, 8))
    loss_fn(reference(inputs), targets).backward()
    grads = _capture_grads(trainer)
    trainer.train_step()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# fp16 loss scaling


def _fp16(init_scale: float = 1024.0, growth_interval: int = 3) -> Precision:
    cfg = TrainConfig(precision="fp16", loss_scale_init=init_scale,
                      loss_scale_growth_interval=growth_interval)
    return Precision(cfg, CPU)


class _Toy:
    """A tiny linear model, an SGD optimizer and the trainer's step protocol around Precision."""

    def __init__(self, precision: Precision, lr: float = 0.1) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(4, 2)
        self.lr = lr
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.precision = precision
        self.x = torch.randn(8, 4)

    def loss(self) -> torch.Tensor:
        return self.model(self.x).pow(2).mean()

    def true_grads(self) -> list[torch.Tensor]:
        return torch.autograd.grad(self.loss(), list(self.model.parameters()))

    def step(self, overflow: bool) -> bool:
        self.precision.backward(self.loss())
        if overflow:
            self.model.weight.grad[0, 0] = float("inf")
        self.precision.unscale_(self.opt)
        stepped = self.precision.step([self.opt])
        self.opt.zero_grad(set_to_none=True)
        return stepped


def test_overflow_skips_the_step_and_halves_the_scale():
    toy = _Toy(_fp16(1024.0, 3))
    before = params(toy.model)
    assert toy.step(overflow=True) is False
    assert toy.precision.loss_scale == 512.0
    for name, p in toy.model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_fp16_steps_several_stages_with_one_scale_update():
    """A rank holding two pipeline stages has two optimizers: both get their gradient unscaled
    exactly once and the scale advances once per step (growth interval 1: 1024 -> 2048)."""
    precision = _fp16(1024.0, 1)
    first, second = _Toy(precision), _Toy(precision)
    expected = [[p - first.lr * g for p, g in zip(toy.model.parameters(), toy.true_grads())] for toy in (first, second)]
    for toy in (first, second):
        precision.backward(toy.loss())
        precision.unscale_(toy.opt)
    assert precision.step([first.opt, second.opt]) is True
    assert precision.loss_scale == 2048.0
    for toy, want in zip((first, second), expected):
        for p, w in zip(toy.model.parameters(), want):
            torch.testing.assert_close(p, w, rtol=1e-6, atol=1e-7)


def test_clean_step_applies_the_unscaled_gradient():
    toy = _Toy(_fp16(1024.0, 3))
    before, grads = params(toy.model), toy.true_grads()
    assert toy.step(overflow=False) is True
    for (name, p), g in zip(toy.model.named_parameters(), grads):
        torch.testing.assert_close(p, before[name] - toy.lr * g, rtol=1e-6, atol=1e-7)
    assert toy.precision.loss_scale == 1024.0


def test_scale_doubles_after_growth_interval_clean_steps():
    toy = _Toy(_fp16(1024.0, 3))
    scales = []
    for _ in range(7):
        assert toy.step(overflow=False)
        scales.append(toy.precision.loss_scale)
    assert scales == [1024.0, 1024.0, 2048.0, 2048.0, 2048.0, 4096.0, 4096.0]


def simulate_loss_scale(overflows: list[bool], scale: float, growth_interval: int) -> list[float]:
    """Dynamic loss scaling (Micikevicius et al. 2018): halve on overflow (and reset the count),
    double after `growth_interval` clean steps in a row. Returns the scale after each step."""
    good, out = 0, []
    for overflow in overflows:
        if overflow:
            scale, good = scale / 2, 0
        else:
            good += 1
            if good >= growth_interval:
                scale, good = scale * 2, 0
        out.append(scale)
    return out


def test_loss_scale_follows_the_reference_protocol():
    flags = [False, False, True, False, False, False, False, True, True, False, False, False,
             False, False, False, False, True, False, False, False]
    expected = simulate_loss_scale(flags, 1024.0, 3)
    toy = _Toy(_fp16(1024.0, 3))
    scales = []
    for overflow in flags:
        assert toy.step(overflow) is (not overflow)
        scales.append(toy.precision.loss_scale)
    assert scales == expected
    assert len(set(scales)) > 2  # the sequence exercises both directions


def test_loss_scaler_state_round_trips():
    flags = [False, True, False, False, False, False, False, False, False]
    head, tail = flags[:5], flags[5:]
    toy = _Toy(_fp16(1024.0, 3))
    for overflow in head:
        toy.step(overflow)
    state = toy.precision.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    resumed = _fp16(4.0, 3)  # the init scale must not matter after loading
    resumed.load_state_dict(state)
    assert resumed.loss_scale == toy.precision.loss_scale
    toy.precision = resumed
    scales = []
    for overflow in tail:
        toy.step(overflow)
        scales.append(toy.precision.loss_scale)
    assert scales == simulate_loss_scale(flags, 1024.0, 3)[len(head):]


# ---------------------------------------------------------------------------------------------
# Mixed precision through the trainer


@pytest.mark.parametrize("mode, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_trainer_steps(tmp_path, make_config, mode, dtype):
    trainer = Trainer(make_config(tmp_path, **{"train.precision": mode, "train.steps": 2}))
    before = params(trainer.model)
    metrics = [trainer.train_step() for _ in range(2)]
    assert all(math.isfinite(m["loss/train"]) and math.isfinite(m["grad/norm"]) for m in metrics)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights
    for state in trainer.optimizer.state.values():
        assert state["exp_avg"].dtype == torch.float32
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    with trainer.precision.autocast():  # the forward does run in the low precision
        logits = trainer.model(torch.zeros(1, 4, dtype=torch.long, device=trainer.device))
    assert logits.dtype == dtype
    if mode == "fp16":
        # Two clean steps, far fewer than the 2,000 the scale waits before doubling: the scale is
        # still train.loss_scale_init's default, 2^16.
        assert [m["precision/loss_scale"] for m in metrics] == [65536.0, 65536.0]
    else:
        assert "precision/loss_scale" not in metrics[-1]


# ---------------------------------------------------------------------------------------------
# Checkpoints


def _optimizer_tensors(trainer: Trainer) -> list[tuple[str, torch.Tensor]]:
    out = []
    for index, state in sorted(trainer.optimizer.state_dict()["state"].items()):
        out += [(f"{index}.{k}", v) for k, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    return out


def _assert_same_state(a: Trainer, b: Trainer) -> None:
    assert a.step == b.step
    names_a = [n for n, _ in a.model.named_parameters()]
    assert names_a == [n for n, _ in b.model.named_parameters()]
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    opt_a, opt_b = _optimizer_tensors(a), _optimizer_tensors(b)
    assert [k for k, _ in opt_a] == [k for k, _ in opt_b]
    assert len(opt_a) == 3 * len(names_a)  # step, exp_avg, exp_avg_sq per parameter
    for (key, ta), (_, tb) in zip(opt_a, opt_b):
        assert torch.equal(ta, tb), key


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resume_is_bit_identical(tmp_path, make_config, precision):
    common = {"train.steps": 6, "checkpoint.interval": 3, "train.precision": precision,
              "train.loss_scale_growth_interval": 2}
    uninterrupted = Trainer(make_config(tmp_path / "a", **common))
    uninterrupted.run()
    ref = {r["step"]: r for r in jsonl(tmp_path / "a" / "run")}
    assert sorted(ref) == [1, 2, 3, 4, 5, 6]

    stopped = Trainer(make_config(tmp_path / "b", **common))
    for _ in range(3):
        stopped.train_step()
    stopped.save()
    del stopped
    resumed = Trainer(make_config(tmp_path / "b", **common, **{"checkpoint.resume": True}))
    assert resumed.step == 3
    resumed.run()
    got = {r["step"]: r for r in jsonl(tmp_path / "b" / "run")}
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):
        assert got[step]["loss/train"] == ref[step]["loss/train"], step
        assert got[step]["grad/norm"] == ref[step]["grad/norm"], step
        assert got[step]["lr"] == ref[step]["lr"], step
        if precision == "fp16":
            assert got[step]["precision/loss_scale"] == ref[step]["precision/loss_scale"], step
    if precision == "fp16":
        # growth interval 2: the scale grows after steps 2, 4 and 6 (the tracker crossed the resume)
        assert [ref[s]["precision/loss_scale"] for s in (1, 2, 3, 4)] == [65536.0, 131072.0, 131072.0, 262144.0]
        assert resumed.precision.loss_scale == uninterrupted.precision.loss_scale
    _assert_same_state(uninterrupted, resumed)
    kept = [s for s, _ in checkpoint.list_checkpoints(tmp_path / "a" / "run" / "checkpoints")]
    assert kept == [3, 6]


def test_fp16_resume_of_an_fp32_checkpoint_starts_at_the_initial_scale(tmp_path, make_config):
    """An fp32 checkpoint has no loss scale: resuming it under fp16 starts from loss_scale_init,
    not from 1 (which underflows fp16 gradients)."""
    trainer = Trainer(make_config(tmp_path, **{"train.steps": 2}))
    trainer.train_step()
    trainer.save()
    resumed = Trainer(make_config(tmp_path, **{"train.steps": 2, "train.precision": "fp16",
                                               "train.loss_scale_init": 1024.0, "checkpoint.resume": True}))
    assert resumed.step == 1
    assert resumed.precision.loss_scale == 1024.0


def test_a_validation_split_smaller_than_a_batch_is_refused(tmp_path, make_config):
    """It used to validate nothing and log val_loss nan with exit 0."""
    from gridtrain.config import ConfigError

    held = Trainer(make_config(tmp_path, **{"train.val_every": 5})).data.val.num_samples
    big = {"train.micro_batch": held + 1, "train.global_batch": held + 1}
    with pytest.raises(ConfigError, match=rf"validation split holds {held} sequences of 32 tokens, fewer than "
                                          rf"one validation batch \({held + 1}\): raise data.val_fraction"):
        Trainer(make_config(tmp_path, **big, **{"train.val_every": 1}))
    Trainer(make_config(tmp_path, **big, **{"train.val_every": 0}))  # no validation: nothing to refuse


def test_resume_refuses_another_global_batch(tmp_path, make_config):
    trainer = Trainer(make_config(tmp_path, **{"train.steps": 2}))
    trainer.train_step()
    trainer.save()
    with pytest.raises(ValueError, match="train.global_batch"):
        Trainer(make_config(tmp_path, **{"train.steps": 2, "train.global_batch": 8,
                                         "checkpoint.resume": True}))


def _toy_state():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


def test_checkpoint_keep_and_latest(tmp_path):
    model, opt = _toy_state()
    root = tmp_path / "ckpt"
    for step in range(1, 6):
        path = checkpoint.save(root, step, [model], [opt], {"step": torch.tensor(step)}, keep=2)
        assert path == root / f"step-{step:07d}"
    assert sorted(p.name for p in root.iterdir()) == ["step-0000004", "step-0000005"]
    assert checkpoint.latest_checkpoint(root) == root / "step-0000005"


def test_incomplete_checkpoints_are_never_chosen(tmp_path):
    model, opt = _toy_state()
    root = tmp_path / "ckpt"
    good = checkpoint.save(root, 5, [model], [opt], {"step": torch.tensor(5)}, keep=3)
    # A crash mid-save leaves a .tmp directory (even one holding .metadata), and a directory
    # without .metadata is incomplete; neither may be picked.
    shutil.copytree(good, root / "step-0000009.tmp")
    (root / "step-0000012").mkdir()
    (root / "step-0000012" / "__0_0.distcp").write_bytes(b"partial")
    shutil.copytree(good, root / "step-13")  # not the step-NNNNNNN pattern
    assert checkpoint.latest_checkpoint(root) == good
    assert checkpoint.list_checkpoints(root) == [(5, good)]
    # Saving over a leftover .tmp of the same step replaces it and leaves no .tmp behind.
    (root / "step-0000006.tmp").mkdir()
    (root / "step-0000006.tmp" / "junk").write_text("x")
    path = checkpoint.save(root, 6, [model], [opt], {"step": torch.tensor(6)}, keep=3)
    assert checkpoint.latest_checkpoint(root) == path
    assert not (root / "step-0000006.tmp").exists() and not (path / "junk").exists()
    assert checkpoint.latest_checkpoint(tmp_path / "nowhere") is None


def test_checkpoint_load_round_trip(tmp_path):
    model, opt = _toy_state()
    path = checkpoint.save(tmp_path, 1, [model], [opt], {"step": torch.tensor(7)}, keep=1)
    torch.manual_seed(1)
    other = nn.Linear(3, 2)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    state = checkpoint.load(path, [other], [other_opt], {"step": torch.tensor(0)})
    assert int(state["step"]) == 7
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
    assert torch.equal(other_opt.state[other.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])


# ---------------------------------------------------------------------------------------------
# Learning-rate schedules


def _lrs(**kw) -> list[float]:
    cfg = TrainConfig(lr=1.0, min_lr_ratio=0.1, **kw)
    return [lr_at(step, cfg) for step in range(cfg.steps)]


def test_warmup_is_linear_from_lr_over_warmup():
    lrs = _lrs(steps=20, warmup_steps=4, schedule="cosine")
    assert lrs[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    assert lrs[0] > 0


def test_cosine_schedule():
    lrs = _lrs(steps=12, warmup_steps=1, schedule="cosine")  # decay over steps 1..11
    assert lrs[0] == pytest.approx(1.0)  # warmup of one step: lr / 1
    assert lrs[1] == pytest.approx(1.0)
    assert lrs[6] == pytest.approx(0.55)  # halfway: (peak + floor) / 2
    assert lrs[-1] == pytest.approx(0.1)  # the last step ends at min_lr_ratio x lr
    assert lrs[3] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))
    assert all(a > b for a, b in zip(lrs[1:], lrs[2:]))


def test_linear_schedule():
    lrs = _lrs(steps=12, warmup_steps=1, schedule="linear")
    assert lrs[1] == pytest.approx(1.0)
    assert lrs[6] == pytest.approx(0.55)
    assert lrs[-1] == pytest.approx(0.1)
    steps = [b - a for a, b in zip(lrs[1:], lrs[2:])]
    assert steps == pytest.approx([-0.09] * 10)


def test_wsd_schedule():
    lrs = _lrs(steps=20, warmup_steps=0, schedule="wsd", decay_fraction=0.2)
    # The last 20% (4 steps, 16..19) decay linearly from the peak to the floor.
    assert lrs[:17] == pytest.approx([1.0] * 17)
    assert lrs[16:] == pytest.approx([1.0, 0.7, 0.4, 0.1])
    lrs = _lrs(steps=22, warmup_steps=2, schedule="wsd", decay_fraction=0.2)
    assert lrs[:2] == pytest.approx([0.5, 1.0])
    assert lrs[2:19] == pytest.approx([1.0] * 17) and lrs[-1] == pytest.approx(0.1)


def test_constant_schedule():
    lrs = _lrs(steps=10, warmup_steps=2, schedule="constant")
    assert lrs == pytest.approx([0.5] + [1.0] * 9)


# ---------------------------------------------------------------------------------------------
# Activation checkpointing


def _loss_and_grads(mode: str):
    args = model_args("tiny")
    model = build_model(args, seed=0, device=CPU)
    calls = []
    # A pre-hook: recomputation stops early, once the last saved tensor is rebuilt (torch's
    # checkpoint early stop), so a forward (post-)hook of the block's last module may never fire.
    model.layers["0"].feed_forward.register_forward_pre_hook(lambda *_: calls.append(1))
    apply_recompute(model, mode)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=g)
    targets = torch.randint(0, args.vocab_size, (2, 24), generator=g)
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return model, loss.detach(), grads, len(calls)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_matches_no_checkpointing(mode):
    ref_model, ref_loss, ref_grads, ref_calls = _loss_and_grads("none")
    model, loss, grads, calls = _loss_and_grads(mode)
    assert (ref_calls, calls) == (1, 2)  # the block really is recomputed in backward
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-6, atol=1e-6)
    assert list(model.state_dict()) == list(ref_model.state_dict())


# ---------------------------------------------------------------------------------------------
# Metrics, plots, the CLI


def test_metrics_file_and_plot(tmp_path, make_config, capsys):
    cfg = make_config(tmp_path, **{"train.steps": 2, "metrics.log_every": 1})
    trainer = Trainer(cfg)
    trainer.run()
    if trainer.device.type == "cpu":
        assert trainer.peak == FAKE_PEAK_FLOPS  # the (fake) calibrated peak of this CPU
    records = jsonl(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    for rec in records:
        for key in ("loss/train", "grad/norm", "lr", "throughput/tokens_per_s", "mfu_pct",
                    "memory/peak_GiB"):
            assert key in rec and math.isfinite(rec[key]) and rec[key] >= 0, key
        assert any(k.startswith("memory/") and k != "memory/peak_GiB" for k in rec)
        tokens_per_s = rec["throughput/tokens_per_s"]
        assert tokens_per_s > 0
        # A step is global_batch 4 x seq_len 32 = 128 tokens.
        assert tokens_per_s == pytest.approx(4 * 32 / rec["time/step_s"], rel=1e-9)
        # MFU is measured against the peak the trainer divides by, one process: on the CPU its
        # (fake) calibrated one, on an accelerator its published dense peak. Model FLOPs
        # per token of `tiny` (dim 64, 2 layers, 4 heads of 16, 2 KV heads, FFN 160, vocab 320,
        # untied) at seq_len 32, 6N + 12 L H Q T, by hand: per layer 64 x (64 + 32 + 32 + 64) +
        # 3 x 64 x 160 + 2 x 64 = 43,136, so N = 2 x 43,136 + 64 (final norm) + 320 x 64 (head) =
        # 106,816 (the input embedding is a lookup); 6 x 106,816 + 12 x 2 x 4 x 16 x 32 = 690,048.
        assert rec["flops/achieved_TFLOPs"] == pytest.approx(690_048 * tokens_per_s / 1e12, rel=1e-9)
        assert rec["mfu_pct"] == pytest.approx(100 * 690_048 * tokens_per_s / (trainer.peak * 1), rel=1e-9)
    out = tmp_path / "curves.png"
    assert main(["plot", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(out) in capsys.readouterr().out


def test_cli_train_end_to_end_lowers_validation_loss(tmp_path, corpus_dir, capsys):
    run_dir = tmp_path / "run"
    code = main(["train", "--model.preset", "tiny", "--data.corpus", str(corpus_dir),
                 "--data.cache_dir", str(tmp_path / "cache"), f"--run_dir={run_dir}",
                 "--data.seq_len", "32", "--train.micro_batch", "2", "--train.global_batch", "4",
                 "--train.steps", "10", "--train.warmup_steps", "1", "--train.val_every", "10",
                 "--train.threads", "1", "--metrics.tensorboard", "false", "--metrics.progress=false"])
    assert code == 0
    records = read_metrics(run_dir)
    val = {r["step"]: r["loss/val"] for r in records if "loss/val" in r}
    assert sorted(val) == [0, 10]
    assert val[0] == pytest.approx(math.log(320), abs=0.1)
    assert val[10] < val[0] - 0.1
    assert [r["step"] for r in records if "loss/train" in r] == list(range(1, 11))
    assert f"final validation loss {val[10]:.4f}" in capsys.readouterr().out


def test_cli_model_prints_llama3_8b(capsys):
    assert main(["model", "llama3-8b"]) == 0
    out = capsys.readouterr().out
    assert "8.03" in out and "8,030,261,248" in out
    assert "ffn 14336" in out


def test_mfu_above_the_peak_points_at_the_calibration():
    """MFU over 100% means the peak it divides by was measured too low: the line says so."""
    assert format_line(3, 10, {"mfu_pct": 42.0}).endswith("mfu 42.0%")
    assert format_line(3, 10, {"mfu_pct": 130.0}).endswith("mfu 130.0% (above the peak: run `gridtrain calibrate` again)")


def test_metrics_survive_a_record_cut_short_by_a_kill(tmp_path):
    """A run killed while writing leaves half a last line: plot and check read the rest, and the
    resumed run's writer cuts it off so that its own records start on a line of their own."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss/train": 2.0}\n{"step": 2, "loss/tr')
    assert read_metrics(tmp_path) == [{"step": 1, "loss/train": 2.0}]
    writer = MetricsWriter(tmp_path, 10, 1, tensorboard=False, progress=False)
    writer.write(2, {"loss/train": 1.5}, echo=False)
    writer.close()
    assert [(r["step"], r["loss/train"]) for r in read_metrics(tmp_path)] == [(1, 2.0), (2, 1.5)]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss/train": 2.0}')  # whole, without its newline
    MetricsWriter(tmp_path, 10, 1, tensorboard=False, progress=False).close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss/train": 2.0}\n'
