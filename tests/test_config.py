import json

import pytest

from gridtrain.cli import main
from gridtrain.config import Config, ConfigError
from gridtrain.config_load import BARE_FLAG, all_keys, load_config, parse_overrides
from gridtrain.rundir import RunRecord
from gridtrain.validate import validate

# (overrides, the key the message must name); each case breaks exactly one relation of the
# (valid) default configuration.
INVALID = [
    pytest.param({"train.steps": "abc"}, "train.steps", id="bad-int"),
    pytest.param({"train.lr": "fast"}, "train.lr", id="bad-float"),
    pytest.param({"train.compile": "maybe"}, "train.compile", id="bad-bool"),
    pytest.param({"train.steps": "none"}, "train.steps", id="none-for-required"),
    pytest.param({"train.steps": "0", "train.warmup_steps": "0"}, "train.steps", id="zero-steps"),
    pytest.param({"train.global_batch": "10", "train.micro_batch": "4"}, "train.global_batch",
                 id="global-batch-not-divisible"),
    pytest.param({"train.global_batch_tokens": "1000", "data.seq_len": "256"},
                 "train.global_batch_tokens", id="batch-tokens-not-multiple-of-seq-len"),
    pytest.param({"train.micro_batch": "0"}, "train.micro_batch", id="zero-micro-batch"),
    pytest.param({"data.seq_len": "2048"}, "data.seq_len", id="seq-len-over-context"),
    pytest.param({"train.lr": "-1e-3"}, "train.lr", id="negative-lr"),
    pytest.param({"train.lr": "0"}, "train.lr", id="zero-lr"),
    pytest.param({"train.warmup_steps": "300", "train.steps": "250"}, "train.warmup_steps",
                 id="warmup-over-steps"),
    pytest.param({"train.schedule": "exponential"}, "train.schedule", id="unknown-schedule"),
    pytest.param({"train.precision": "fp8"}, "train.precision", id="unknown-precision"),
    pytest.param({"train.recompute": "some"}, "train.recompute",
                 id="unknown-recompute"),
    pytest.param({"model.n_heads": "12"}, "model.n_heads", id="n-heads-not-dividing-dim"),
    pytest.param({"model.n_kv_heads": "3"}, "model.n_kv_heads", id="n-kv-heads-not-dividing-n-heads"),
    pytest.param({"model.n_heads": "256"}, "model.n_heads", id="odd-head-dim"),
    pytest.param({"model.dim": "0"}, "model.dim", id="zero-dim"),
    pytest.param({"model.vocab_size": "256"}, "model.vocab_size", id="vocab-below-byte-tokenizer"),
    pytest.param({"train.grad_clip": "-1"}, "train.grad_clip", id="negative-grad-clip"),
    pytest.param({"train.beta2": "1.0"}, "train.beta2", id="beta2-one"),
    pytest.param({"train.beta1": "-0.1"}, "train.beta1", id="negative-beta1"),
    pytest.param({"train.min_lr_ratio": "1.5"}, "train.min_lr_ratio", id="min-lr-ratio-over-one"),
    pytest.param({"train.decay_fraction": "0"}, "train.decay_fraction", id="zero-decay-fraction"),
    pytest.param({"train.loss_scale_growth_interval": "0"}, "train.loss_scale_growth_interval",
                 id="zero-growth-interval"),
    pytest.param({"train.threads": "0"}, "train.threads", id="zero-threads"),
    pytest.param({"checkpoint.interval": "-1"}, "checkpoint.interval", id="negative-checkpoint-interval"),
    pytest.param({"checkpoint.keep": "0"}, "checkpoint.keep", id="zero-keep"),
    pytest.param({"metrics.log_every": "0"}, "metrics.log_every", id="zero-log-every"),
    pytest.param({"data.val_fraction": "0.7"}, "data.val_fraction", id="val-fraction-too-large"),
    pytest.param({"data.corpus": "/nonexistent/gridtrain-corpus"}, "data.corpus", id="missing-corpus"),
    pytest.param({"data.tokenizer": "bpe:abc"}, "data.tokenizer", id="bpe-without-number"),
    pytest.param({"data.tokenizer": "bpe:100"}, "data.tokenizer", id="bpe-too-small"),
    pytest.param({"data.tokenizer": "wordpiece"}, "data.tokenizer", id="unknown-tokenizer"),
    pytest.param({"model.preset": "gpt-5"}, "model.preset", id="unknown-preset"),
]


def test_default_config_is_valid(monkeypatch):
    # The table below relies on it. One process (parallel.nproc = 1, no torchrun): every degree 1.
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dims = validate(load_config(None, {}))
    assert dims.world_size == 1
    assert dims.degrees == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
    # On 4 processes the default dp_shard = -1 with ZeRO-3 takes the whole world: FSDP over 4,
    # each rank one micro-batch of 4 of the 16 sequences per step.
    dims = validate(load_config(None, {}), world=4)
    assert dims.degrees == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1} and dims.dp == 4


@pytest.mark.parametrize("overrides, key", INVALID)
def test_invalid_configuration_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, overrides))
    assert len(info.value.problems) == 1, info.value.problems
    assert key in info.value.problems[0]
    assert key in str(info.value)


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(ConfigError) as info:
        load_config(None, {"train.step": "10"})
    message = str(info.value)
    assert "train.step'" in message and "did you mean 'train.steps'" in message


def test_all_problems_are_reported_together():
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, {"train.lr": "0", "train.schedule": "exp", "metrics.log_every": "0"}))
    text = "\n".join(info.value.problems)
    assert len(info.value.problems) == 3
    assert all(k in text for k in ("train.lr", "train.schedule", "metrics.log_every"))


def test_batch_message_gives_a_fix():
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, {"train.global_batch": "10", "train.micro_batch": "4"}))
    assert "train.micro_batch (4)" in str(info.value)
    assert "set train.global_batch to 8 " in str(info.value)  # the nearest multiple of 4
    with pytest.raises(ConfigError, match=r"degree \(2\) = 16: set train.global_batch to 32 "):
        validate(load_config(None, {"train.global_batch": "24", "train.micro_batch": "8"}), world=2)
    validate(load_config(None, {"train.global_batch": "32", "train.micro_batch": "8"}), world=2)


def test_global_batch_tokens_sets_sequences():
    cfg = load_config(None, {"train.global_batch_tokens": "4096", "data.seq_len": "256",
                             "train.micro_batch": "4"})
    validate(cfg)
    assert cfg.global_batch_seqs == 16


# ---------------------------------------------------------------------------------------------
# TOML files and overrides


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('run_dir = "runs/x"\n'
                    '[model]\npreset = "tiny"\nn_layers = 3\n'
                    '[train]\nsteps = 100\nlr = 0.01\ncompile = true\n'
                    '[checkpoint]\ninterval = 5\n')
    cfg = load_config(path, {"train.steps": "7", "checkpoint.interval": 0})
    assert cfg.run_dir == "runs/x"
    assert cfg.model.preset == "tiny" and cfg.model.n_layers == 3
    assert cfg.model.args().n_layers == 3 and cfg.model.args().dim == 64
    assert cfg.train.steps == 7  # the override wins over the file
    assert cfg.train.lr == 0.01 and cfg.train.compile is True
    assert cfg.checkpoint.interval == 0
    assert cfg.train.warmup_steps == Config().train.warmup_steps  # untouched keys keep defaults


def test_toml_unknown_key_and_bad_type(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nstepz = 3\nlr = true\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.problems) == 2
    assert "train.stepz" in str(info.value) and "train.steps" in str(info.value)
    assert "train.lr" in str(info.value)


def test_parse_overrides_forms():
    args = ["--train.steps=5", "--train.lr", "-1e-3", "--train.compile", "--checkpoint.resume",
            "--metrics.log-every", "3", "--run_dir=a=b"]
    assert parse_overrides(args) == {
        "train.steps": "5", "train.lr": "-1e-3", "train.compile": BARE_FLAG,
        "checkpoint.resume": BARE_FLAG, "metrics.log_every": "3", "run_dir": "a=b"}
    assert parse_overrides(["--train.compile"]) == {"train.compile": BARE_FLAG}  # bare flag at the end
    cfg = load_config(None, parse_overrides(args))
    assert cfg.train.compile is True and cfg.checkpoint.resume is True
    with pytest.raises(ConfigError, match=r"^invalid configuration: --train.steps needs a value \(--train.steps VALUE\)$"):
        load_config(None, parse_overrides(["--train.steps", "--train.compile"]))
    with pytest.raises(ConfigError, match="unexpected argument 'stray'"):
        parse_overrides(["--train.steps", "5", "stray"])


def test_override_values_are_converted():
    cfg = load_config(None, parse_overrides(
        ["--train.steps", "1e3", "--train.lr=3e-4", "--train.compile", "--model.rope_scaling", "off",
         "--train.threads", "none", "--model.dim", "1_024"]))
    assert cfg.train.steps == 1000 and isinstance(cfg.train.steps, int)
    assert cfg.train.lr == 3e-4
    assert cfg.train.compile is True
    assert cfg.model.rope_scaling is False
    assert cfg.train.threads is None
    assert cfg.model.dim == 1024
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(None, {"train.steps": "2.5"})


REQUIRED_KEYS = [
    "run_dir", "model.preset", "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads",
    "model.ffn_dim", "model.vocab_size", "data.corpus", "data.tokenizer", "data.seq_len",
    "train.steps", "train.global_batch", "train.micro_batch", "train.lr", "train.warmup_steps",
    "train.schedule", "train.precision", "train.recompute", "train.seed",
    "train.compile", "checkpoint.dir", "checkpoint.interval", "metrics.log_every",
]


def test_all_keys_cover_the_issue_and_are_documented():
    keys = all_keys()
    missing = [k for k in REQUIRED_KEYS if k not in keys]
    assert not missing
    undocumented = [k for k, (_, doc) in keys.items() if not doc.strip()]
    assert not undocumented
    assert len(keys) > len(REQUIRED_KEYS)


def test_help_config_lists_every_key(capsys):
    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert all(f"--{k} " in out for k in all_keys())


# ---------------------------------------------------------------------------------------------
# The CLI reports a bad configuration before training


@pytest.mark.parametrize("lr_args", [["--train.lr", "-1"], ["--train.lr=-1"]])
def test_cli_rejects_bad_config_without_training(tmp_path, corpus_dir, capsys, monkeypatch, lr_args):
    import gridtrain.train.trainer as trainer

    def no_training(*args, **kwargs):
        raise AssertionError("training started on an invalid configuration")

    monkeypatch.setattr(trainer.Trainer, "__init__", no_training)
    run_dir = tmp_path / "run"
    code = main(["train", "--model.preset", "tiny", "--data.corpus", str(corpus_dir),
                 "--data.cache_dir", str(tmp_path / "cache"), "--run_dir", str(run_dir),
                 "--data.seq_len", "32", *lr_args])
    err = capsys.readouterr().err
    assert code == 2
    assert "train.lr" in err and "-1" in err
    assert not run_dir.exists() and not (tmp_path / "cache").exists()


def test_cli_reports_unknown_key(capsys):
    assert main(["train", "--train.step", "3"]) == 2
    assert "did you mean 'train.steps'" in capsys.readouterr().err


def test_a_prepared_corpus_larger_than_the_model_vocabulary_is_refused(tmp_path):
    """The check reads the vocabulary of the data actually used (a prepared corpus's index), not
    data.tokenizer: such a corpus used to crash mid-run with `IndexError: index out of range`."""
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "index.json").write_text(json.dumps({"vocab_size": 1000}))
    cfg = load_config(None, {"model.preset": "tiny", "data.corpus": str(prepared)})  # tokenizer: byte
    with pytest.raises(ConfigError, match=rf"model.vocab_size \(320\) is smaller than the vocabulary of the "
                                          rf"prepared corpus {prepared} \(1000\): set model.vocab_size to at least 1024"):
        validate(cfg)
    validate(load_config(None, {"model.preset": "tiny", "model.vocab_size": "1024", "data.corpus": str(prepared)}))


def test_help_config_into_a_closed_pipe_is_quiet():
    """`gridtrain train --help-config | head -1` printed a BrokenPipeError traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(f"{sys.executable} -m gridtrain train --help-config | head -1", shell=True,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
    assert proc.stdout.startswith("--") and proc.stdout.count("\n") == 1
    assert proc.stderr == "", proc.stderr


@pytest.mark.parametrize("batch", [{"train.global_batch": 8}, {"train.global_batch_tokens": 8 * 256}])
def test_a_run_record_reads_back_the_config_and_layout_it_was_written_with(tmp_path, batch):
    """RunRecord.load gives plan --check and export the Config and ParallelDims the run had,
    whichever form of the batch it was given in (the record keeps both, one of them None)."""
    cfg = load_config(None, {"data.seq_len": 256, "train.micro_batch": 2, "train.recompute": "none",
                             "parallel.pp": 2, "parallel.pp_schedule": "zbv", "parallel.pp_virtual_stages": 2,
                             **batch})
    dims = validate(cfg, 2)
    RunRecord(cfg, dims, "cpu", 3, 8, 1e12).write(tmp_path)
    back = RunRecord.load(tmp_path)
    assert back.config == cfg and back.dims == dims and (back.threads, back.cpu_count) == (3, 8)
    assert back.config.microbatches(dims.dp) == 4 and back.config.train.recompute == "none"


def test_a_renamed_key_says_its_new_name():
    with pytest.raises(ConfigError, match=r"'train.activation_checkpointing' is now train.recompute \('off' is now 'none'\)"):
        load_config(None, {"train.activation_checkpointing": "off"})
