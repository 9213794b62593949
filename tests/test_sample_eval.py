"""What a run learned: `gridtrain sample` and `gridtrain eval` from a run's checkpoints in one
process. Greedy tokens against transformers' LlamaForCausalLM.generate on the exported weights,
with the KV cache and without; an FSDP 2 x TP 2 checkpoint against the same run in one process;
eval against the training log's validation loss; every run keeping its model; and the bad inputs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from gridtrain.cli import main
from gridtrain.config_load import load_config
from gridtrain.model.generate import Sampling, generate, next_token
from gridtrain.train.hf_run import export_run
from gridtrain.train.inference import evaluate, load_run, validation_batches
from gridtrain.train.trainer import Trainer

PROMPTS = ["The model ", "Document 7\n\nA quick", "rank"]
TRAIN = {"train.steps": 8, "train.lr": 0.02, "train.warmup_steps": 1, "train.val_every": 4, "train.global_batch": 8,
         "train.micro_batch": 2, "checkpoint.final": True}


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def greedy(run, prompt: str, use_cache: bool = True, n: int = 32) -> list[int]:
    ids = torch.tensor([[int(i) for i in run.tokenizer.encode(prompt)]])
    return [int(t[0]) for t in generate(run.model, ids, n, Sampling(temperature=0), use_cache=use_cache)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("sample-one")
    items = tiny_overrides(root, corpus_dir) | TRAIN
    Trainer(load_config(None, items)).run()
    return Path(items["run_dir"])


def test_greedy_tokens_equal_transformers_generate_with_and_without_the_cache(one_process, tmp_path):
    from transformers import LlamaForCausalLM

    run = load_run(one_process)
    hf = LlamaForCausalLM.from_pretrained(export_run(one_process, tmp_path / "hf"), dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = torch.tensor([[int(i) for i in run.tokenizer.encode(prompt)]])
        theirs = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                             attention_mask=torch.ones_like(ids), pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert greedy(run, prompt) == theirs, prompt
        assert greedy(run, prompt, use_cache=False) == theirs, prompt
    assert len(set(theirs)) > 1  # a model that says something, not one token over and over


def test_sample_streams_what_it_generates_and_greedy_is_deterministic(one_process):
    code, first, err = cli("sample", str(one_process), "--prompt", "The ", "--max-new-tokens", "24",
                           "--temperature", "0")
    assert code == 0 and first.startswith("The ") and "step-0000008" in err
    run = load_run(one_process)
    assert first == "The " + run.tokenizer.decode(greedy(run, "The ", n=24)) + "\n"
    assert cli("sample", str(one_process), "--prompt", "The ", "--max-new-tokens", "24", "--temperature", "0")[1] == first
    # Sampled: the seed decides, and --num-samples writes each under its own header.
    a = cli("sample", str(one_process), "--seed", "3", "--num-samples", "2", "--max-new-tokens", "16")[1]
    b = cli("sample", str(one_process), "--seed", "3", "--num-samples", "2", "--max-new-tokens", "16")[1]
    assert a == b and a.count("--- sample") == 2


def last_val_loss(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss/val"] for r in rows if "loss/val" in r][-1]


def test_eval_reproduces_the_training_logs_validation_loss(one_process):
    code, out, _ = cli("eval", str(one_process), "--json")
    result = json.loads(out)
    assert code == 0 and result["loss"] == pytest.approx(last_val_loss(one_process), rel=1e-6, abs=0)
    # Bytes per token: 1 for the byte tokenizer (no <eos> among the targets here).
    assert result["bits_per_byte"] == pytest.approx(result["loss"] / 0.6931471805599453 * result["tokens"]
                                                    / result["bytes"])
    assert result["perplexity"] == pytest.approx(2.718281828459045 ** result["loss"])


def test_eval_reads_any_text(one_process, corpus_dir):
    code, out, _ = cli("eval", str(one_process), "--data", str(corpus_dir / "doc001.txt"), "--batches", "3", "--json")
    result = json.loads(out)
    assert code == 0 and result["sequences"] == 6 and result["tokens"] == 6 * 32
    assert 0 < result["loss"] < 6


@pytest.mark.dist
@pytest.mark.parametrize("layout", [{"parallel.dp_shard": 2, "parallel.tp": 2},  # the issue's
                                    {"parallel.pp": 2, "parallel.cp": 2}],  # validation through a pipeline of CP ranks
                         ids=["fsdp2_tp2", "pp2_cp2"])
def test_a_sharded_checkpoint_samples_and_evaluates_as_one_process(one_process, tmp_path, corpus_dir, layout):
    items = tiny_overrides(tmp_path, corpus_dir) | TRAIN | layout
    flags = [arg for key, value in items.items() for arg in (f"--{key}", str(value).lower())]
    proc = subprocess.run([sys.executable, "-m", "gridtrain", "train", "--nproc", "4", *flags], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded, single = load_run(Path(items["run_dir"])), load_run(one_process)
    for prompt in PROMPTS:
        assert greedy(sharded, prompt) == greedy(single, prompt), prompt
    loss = evaluate(sharded, validation_batches(sharded, Path(items["run_dir"])))["loss"]
    assert loss == pytest.approx(evaluate(single, validation_batches(single, one_process))["loss"], rel=1e-5)
    assert loss == pytest.approx(last_val_loss(Path(items["run_dir"])), rel=1e-5)


def test_a_run_keeps_its_model_by_default(tmp_path, corpus_dir):
    items = {k: v for k, v in tiny_overrides(tmp_path, corpus_dir).items()
             if k not in ("checkpoint.interval", "checkpoint.final", "train.sample_tokens")}
    flags = [arg for key, value in items.items() for arg in (f"--{key}", str(value).lower())]
    code, out, _ = cli("train", *flags)
    assert code == 0
    run_dir = Path(items["run_dir"])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1] == "step-0000004"
    assert "sample of the model at step 4" in out  # the end-of-run sample
    assert cli("sample", str(run_dir), "--max-new-tokens", "8")[0] == 0
    assert cli("eval", str(run_dir), "--batches", "1")[0] == 0
    assert cli("export", str(run_dir), str(tmp_path / "hf"))[0] == 0


def test_bad_inputs_get_one_clear_line(one_process, tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "config.json").write_text((one_process / "config.json").read_text())
    code, _, err = cli("sample", str(empty))
    assert code == 2 and "no intact checkpoint" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("eval", str(one_process), "--step", "5")
    assert code == 2 and "no checkpoint of step 5" in err and "[8]" in err
    code, _, err = cli("sample", str(tmp_path / "nowhere"))
    assert code == 2 and "not a gridtrain run directory" in err
    code, _, err = cli("sample", str(one_process), "--prompt", "\udcff")  # a lone surrogate: no UTF-8
    assert code == 2 and "cannot encode the prompt" in err
    code, _, err = cli("sample", str(one_process), "--prompt", "x", "--prompt-file", "f")
    assert code == 2 and "give one" in err
    # A prompt longer than the run's sequence (32) is cut from the left, at a character, and said so.
    code, out, err = cli("sample", str(one_process), "--prompt", "a" * 300 + "é" * 12 + "END", "--max-new-tokens",
                         "6", "--temperature", "0")
    assert code == 0 and "kept the prompt's last 25 tokens" in err and out.startswith("é" * 11 + "END")
    code, _, err = cli("sample", str(one_process), "--max-new-tokens", "32")
    assert code == 2 and "leaves no room for a prompt" in err


def test_a_corrupted_checkpoint_offers_the_intact_one(tmp_path, corpus_dir):
    items = tiny_overrides(tmp_path, corpus_dir) | {"checkpoint.interval": 2}
    Trainer(load_config(None, items)).run()
    root = Path(items["run_dir"]) / "checkpoints"
    newest = root / "step-0000004"
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-7] + b"garbage")
    code, _, err = cli("sample", items["run_dir"], "--step", "4")
    assert code == 2 and "is not intact" in err and "step 2 (--step 2)" in err
    code, out, err = cli("sample", items["run_dir"], "--max-new-tokens", "4")  # the newest intact one
    assert code == 0 and "step-0000002" in err


def test_sampling_keeps_to_the_tokenizers_vocabulary_and_its_filters():
    padded = torch.zeros(1, 320)
    padded[0, 300] = 50.0  # a padded id the tokenizer (257 ids) does not have would win
    g = torch.Generator().manual_seed(0)
    assert next_token(padded, Sampling(0), None, vocab=257).item() < 257
    assert (next_token(padded.repeat(200, 1), Sampling(1.0), g, vocab=257) < 257).all()
    assert next_token(torch.tensor([[0.0, 1e30, 5.0]]), Sampling(1e-40), None).item() == 1  # greedy, no overflow
    # Probabilities 0.5, 0.3, 0.15, 0.05: top-p 0.7 keeps the first two (0.5 < 0.7 <= 0.8), top-k 1 the first.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(4000, 1)
    drawn = next_token(logits, Sampling(1.0, top_p=0.7), g)
    assert set(drawn.tolist()) == {0, 1} and (drawn == 0).float().mean().item() == pytest.approx(0.5 / 0.8, abs=0.03)
    assert set(next_token(logits, Sampling(1.0, top_k=1), g).tolist()) == {0}
    assert set(next_token(logits, Sampling(1.0, top_k=3), g).tolist()) == {0, 1, 2}


def test_the_stream_writes_exactly_the_decoded_text():
    """Random byte tokens (ASCII, lead and continuation bytes, invalid ones): what the stream has
    written when it closes is the decoding of all of them, however the characters split."""
    import random

    from gridtrain.data.tokenizer import ByteTokenizer
    from gridtrain.train.inference import TextStream

    tok, rng = ByteTokenizer(), random.Random(0)
    for _ in range(3000):
        ids = [rng.choice([rng.randrange(256), rng.randrange(0x80, 0xC0), rng.randrange(0xC0, 0xF5), 97])
               for _ in range(rng.randrange(1, 12))]
        out = io.StringIO()
        stream = TextStream(tok, out)
        for i in ids:
            stream.add(i)
        assert stream.close() == out.getvalue() == tok.decode(ids), ids
