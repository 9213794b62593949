"""Bad input, whatever the command: exit status 2, one line on stderr that names the value and
the fix, no traceback, and nothing written. Table-driven: each case is argv, the words the
message must hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from gridtrain.cli import main

CASES = [
    # plan
    (["plan", "--top", "0"], "--top: 0 must be >= 1"),
    (["plan", "--top", "-1"], "--top: -1 must be >= 1"),
    (["plan", "--top", "x"], "--top: 'x' is not a whole number"),
    (["plan", "--num-gpus", "1.5"], "--num-gpus = '1.5' is 1.5, not a whole number"),
    (["plan", "--num-gpus", "0"], "--num-gpus = '0' must be a positive finite count"),
    (["plan", "--num-gpus", "inf"], "--num-gpus = 'inf' must be a positive finite count"),
    (["plan", "--seq-len", "-5"], "--seq-len = '-5' must be a positive finite count"),
    (["plan", "--global-batch", "2.5"], "--global-batch = '2.5' is 2.5, not a whole number"),
    (["plan", "--tokens", "abc"], "--tokens = 'abc' is not a count"),
    (["plan", "--price", "-2"], "--price: -2 must be >= 0"),
    (["plan", "--pue", "0.5"], "--pue: 0.5 must be >= 1"),
    (["plan", "--electricity-price", "nan"], "--electricity-price: nan must be >= 0"),
    (["plan", "--mtbf-hours", "0"], "--mtbf-hours: 0 must be > 0"),
    (["plan", "--mtbf-hours", "inf"], "--mtbf-hours: inf must be > 0"),
    (["plan", "--hbm-usable", "0"], "--hbm-usable: 0 must be > 0 and <= 1"),
    (["plan", "--hbm-usable", "1.5"], "--hbm-usable: 1.5 must be > 0 and <= 1"),
    (["plan", "--precision", "fp8"], "invalid choice: 'fp8'"),
    # model
    (["model", "nosuch"], "unknown model preset 'nosuch'; choose one of"),
    (["model", "llama3-8b", "--seq-len", "-5"], "--seq-len: -5 must be >= 1"),
    (["model", "llama3-8b", "--seq-len", "0"], "--seq-len: 0 must be >= 1"),
    # train (refused before anything starts)
    (["train", "--max-restarts", "-1"], "--max-restarts: -1 must be >= 0"),
    (["train", "--nproc", "0"], "--nproc: 0 must be >= 1"),
    (["train", "--train.threads", "0"], "train.threads"),
    (["train", "--checkpoint.signal_grace_s", "-1"], "checkpoint.signal_grace_s = -1.0 must be a number of seconds >= 0"),
    (["train", "--checkpoint.signal_grace_s", "inf"], "checkpoint.signal_grace_s = inf must be"),
    (["train", "--train.step", "3"], "train.step"),
    (["train", "--run_dir", ""], "run_dir is empty (it would write into the current directory)"),
    (["train", "--config", "missing.toml"], "--config missing.toml: no such file or directory"),
    (["train", "--config", "."], "--config .: is a directory"),
    # data prepare, calibrate, export
    (["data", "prepare", "--val-fraction", "0"], "--val-fraction: 0 must be > 0 and <= 0.5"),
    (["data", "prepare", "--val-fraction", "0.9"], "--val-fraction: 0.9 must be > 0 and <= 0.5"),
    (["data", "prepare", "--seed", "-1"], "--seed: -1 must be >= 0"),
    (["calibrate", "--seconds", "0"], "--seconds: 0 must be > 0 and <= 600"),
    (["calibrate", "--threads", "100000"], "--threads: 100000 must be >= 1 and <= "),
    (["export", "run", "out", "--step", "-3"], "--step: -3 must be >= 0"),
    (["bogus"], "invalid choice: 'bogus'"),
]


def run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:  # argparse's errors
        return exit_.code


@pytest.mark.parametrize("argv,words", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_gets_one_clear_line(argv, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    before = sorted(Path(tmp_path).rglob("*"))
    assert run(argv) == 2
    out, err = capsys.readouterr()
    assert words in err, err
    assert "Traceback" not in err and out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("gridtrain") and (len(lines) == 1 or lines[0].endswith("invalid configuration:")), err
    assert sorted(Path(tmp_path).rglob("*")) == before  # nothing written where it ran


def test_a_config_that_is_not_toml_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("x = [\n")
    assert run(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"--config {bad} is not valid TOML" in err and "Traceback" not in err
