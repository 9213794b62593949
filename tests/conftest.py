"""Shared fixtures: a fake CPU calibration (no test measures matmul peaks), a tiny deterministic
text corpus, and `make_config` for the `tiny` model preset on that corpus."""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from gridtrain.config import Config
from gridtrain.config_load import load_config
from gridtrain.plan.machine import machine_key
from gridtrain.train import calibrate as hardware
from gridtrain.train.calibrate import CALIBRATION_DTYPES
from launches import Launches
from workers import ALONE, Turns, assign_groups, group_of, make_scheduler, run_folder, starts_processes

FAKE_PEAK_FLOPS = 1.0e11
TURNS = pytest.StashKey[Turns]()
FOLDER = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (tests/workers.py), the run's folder: the workers' run id, which the
    controller sets so that its scheduler finds the groups they write."""
    if hasattr(config, "workerinput"):
        config.stash[FOLDER] = run_folder(config.workerinput["testrunuid"])
        config.stash[FOLDER].mkdir(exist_ok=True)
        config.stash[TURNS] = Turns(config.stash[FOLDER])
    elif config.getoption("dist", "no") != "no" and config.getoption("tx", None):  # -n N, or --tx
        config.option.testrunuid = config.option.testrunuid or uuid.uuid4().hex
        config.stash[FOLDER] = run_folder(config.option.testrunuid)
        config.stash[FOLDER].mkdir(exist_ok=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    if FOLDER in config.stash and not hasattr(config, "workerinput"):
        shutil.rmtree(config.stash[FOLDER], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if config.getvalue("dist") != "load" or FOLDER not in config.stash:  # -n 2 alone: --dist load
        return None  # what was asked for (xdist's own)
    return make_scheduler(config, log, config.stash[FOLDER])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if TURNS in config.stash:
        assign_groups(items, config.stash[FOLDER])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ANN201 - a hook wrapper
    """Under xdist, an `alone` test runs while no other worker's `dist` test does (tests/workers.py)."""
    turns = item.config.stash.get(TURNS, None)
    if turns is None or (group_of(item) != ALONE and not starts_processes(item)):
        return (yield)
    if group_of(item) != ALONE:
        with turns.shared():
            return (yield)
    turns.enter_alone()
    try:
        return (yield)
    finally:  # after the group, or where the session stops early (-x): the other worker waits on it
        if nextitem is None or group_of(nextitem) != ALONE or item.session.shouldfail or item.session.shouldstop:
            turns.leave_alone()


def pytest_sessionfinish(session: pytest.Session) -> None:
    turns = session.config.stash.get(TURNS, None)
    if turns is not None:
        turns.leave_alone()


@pytest.fixture(scope="session", autouse=True)
def fake_calibration(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Point GRIDTRAIN_CACHE at a session directory holding peaks for every thread count the
    tests may run with (the trainer sets torch's thread count from train.threads)."""
    cache = tmp_path_factory.mktemp("gridtrain-cache")
    max_threads = max(os.cpu_count() or 1, torch.get_num_threads())
    entries = {machine_key(n): {"peak_flops": {mode: FAKE_PEAK_FLOPS for mode in CALIBRATION_DTYPES},
                                "attention_flops": {mode: FAKE_PEAK_FLOPS / 2 for mode in CALIBRATION_DTYPES},
                                "memory_bytes_per_s": 1e10, "gloo_bytes_per_s": 1e9, "gloo_latency_s": 1e-4}
               for n in range(1, max_threads + 1)}
    (cache / "calibration.json").write_text(json.dumps(entries))
    old = os.environ.get("GRIDTRAIN_CACHE")
    os.environ["GRIDTRAIN_CACHE"] = str(cache)
    # The machine is shared with benchmarks: one thread for everything the tests run.
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield cache
    torch.set_num_threads(old_threads)
    if old is None:
        os.environ.pop("GRIDTRAIN_CACHE", None)
    else:
        os.environ["GRIDTRAIN_CACHE"] = old


@pytest.fixture(autouse=True)
def no_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that would measure the CPU (a cache miss) fails instead of spending seconds."""

    def refuse(*args: Any, **kwargs: Any) -> dict[str, float]:
        raise AssertionError("a test tried to calibrate the CPU: the fake calibration missed "
                             f"(key {machine_key(torch.get_num_threads())})")

    monkeypatch.setattr(hardware, "calibrate", refuse)
    monkeypatch.setattr(hardware, "_MEASURED", {})  # what another test's process measured


_WORDS = (
    "the a an of to in and or but if when while model token layer batch step loss rate grid "
    "train data shard rank pipeline tensor gradient weight optimizer scale memory device small "
    "large quick brown fox lazy dog river stone light shadow north south old new green blue red "
    "house garden window paper letter number story reason simple careful early late under over"
).split()


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice((".", ".", ".", "?", "!"))


def write_corpus(root: Path, num_docs: int = 100, seed: int = 0) -> Path:
    """`num_docs` pseudo-English documents of about 3 KB each (about 300 KB in all)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(num_docs):
        paragraphs = [" ".join(_sentence(rng) for _ in range(rng.randint(3, 7))) for _ in range(12)]
        (root / f"doc{i:03d}.txt").write_text(f"Document {i}\n\n" + "\n\n".join(paragraphs) + "\n")
    return root


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def launches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> Launches:
    """One torchrun launch per world size for the cases of the modules whose selected tests use
    it (tests/launches.py)."""
    modules = {item.module for item in request.session.items if "launches" in getattr(item, "fixturenames", ())}
    return Launches(list(modules), tmp_path_factory.mktemp("launches"), corpus_dir)


def tiny_overrides(tmp_path: Path, corpus: Path) -> dict[str, Any]:
    return {
        "run_dir": str(tmp_path / "run"),
        "model.preset": "tiny",
        "data.corpus": str(corpus),
        "data.cache_dir": str(tmp_path / "data-cache"),
        "data.seq_len": 32,
        "train.micro_batch": 2,
        "train.global_batch": 4,
        "train.steps": 4,
        "train.warmup_steps": 1,
        "train.val_every": 0,
        "train.threads": 1,
        "metrics.tensorboard": False,
        "metrics.progress": False,
        "checkpoint.interval": 0,  # tests that save ask for it
        "checkpoint.final": False,
        "train.sample_tokens": 0,
    }


@pytest.fixture
def make_config(corpus_dir: Path) -> Callable[..., Config]:
    """make_config(tmp_path, **overrides) -> Config of the tiny preset on the tiny corpus.

    Override keys are dotted (`**{"train.steps": 6}`) or use '__' for the dot (`train__steps=6`).
    """

    def make(tmp_path: Path, **overrides: Any) -> Config:
        items = tiny_overrides(Path(tmp_path), corpus_dir)
        items.update({k.replace("__", "."): v for k, v in overrides.items()})
        return load_config(None, items)

    return make


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """Trainers built in the test train on the CPU even where an accelerator is present (they
    pick it when there is one): for tests of the CPU's own path, such as its calibrated peak.
    The Trainer's device comes from init_world, which calls distributed.pick_device."""
    from gridtrain.train import distributed

    cpu = torch.device("cpu")
    monkeypatch.setattr(distributed, "pick_device", lambda: cpu)
    return cpu


@pytest.fixture
def checkpoint_weights() -> Callable[[Path], dict[str, torch.Tensor]]:
    """checkpoint_weights(path) -> the tiny model's weights in a checkpoint, loaded in this
    process (DCP reshards whatever layout wrote it to one rank)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from gridtrain.model.args import model_args
    from gridtrain.model.llama import Transformer

    def load(path: Path) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            model = Transformer(model_args("tiny"))
        model.to_empty(device="cpu")
        state = {"model": model.state_dict()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(state, checkpoint_id=path)
        return state["model"]

    return load


def cli_train(run_dir: Path, corpus: Path, *extra: str) -> int:
    """`gridtrain train` in this process on the tiny model: 2 steps of 4 sequences of 32 tokens, a
    checkpoint at step 2, no validation; `extra` flags last."""
    from gridtrain.cli import main

    return main(["train", "--model.preset", "tiny", "--data.corpus", str(corpus),
                 "--data.cache_dir", str(run_dir.parent / "cache"), f"--run_dir={run_dir}",
                 "--data.seq_len", "32", "--train.micro_batch", "2", "--train.global_batch", "4",
                 "--train.steps", "2", "--train.warmup_steps", "1", "--train.val_every", "0",
                 "--train.threads", "1", "--checkpoint.interval", "2", "--metrics.tensorboard", "false",
                 "--metrics.progress=false", *extra])
