"""Checkpoints that never lose work: manifests, verification, skipping corrupt checkpoints, failed
saves (injected and real: a full tmpfs, a read-only mount, a read-only directory), keep-K pruning
and asynchronous saves. Single process: DCP runs without a process group."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import nn

from gridtrain.model.args import model_args
from gridtrain.model.llama import Transformer
from gridtrain.checkpoint import store as checkpoint
from gridtrain.checkpoint.store import (AsyncSaver, CheckpointSaveError,
                                        InvalidCheckpointError, latest_valid_checkpoint, load, save)
from gridtrain.checkpoint.writer import FAULT_ENV
from gridtrain.checkpoint.manifest import MANIFEST, verify

SHARD = "__0_0.distcp"  # a world of one writes a single shard


def _model(seed: int) -> tuple[Transformer, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Transformer(model_args("tiny"))
    model.init_weights(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    tokens = torch.randint(0, model.args.vocab_size, (2, 16))
    logits = model(tokens)
    nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    opt.step()
    opt.zero_grad()


def _trainer_state(step: int) -> dict[str, torch.Tensor]:
    return {"step": torch.tensor(step), "samples": torch.tensor(16 * step), "rng": torch.get_rng_state()}


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer,
              state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint should restore, copied."""
    snap = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        snap.update({f"optim.{name}.{k}": v.clone() for k, v in opt.state[p].items()})
    snap.update({f"trainer.{k}": v.clone() for k, v in state.items()})
    return snap


def _assert_restores(path: Path, expected: dict[str, torch.Tensor]) -> None:
    """Loading `path` into a differently initialised model gives exactly `expected`."""
    model, opt = _model(seed=99)
    _train_step(model, opt)
    before = _snapshot(model, opt, _trainer_state(0))
    assert not torch.equal(before["model.output.weight"], expected["model.output.weight"])
    state = load(path, [model], [opt], _trainer_state(0))
    after = _snapshot(model, opt, state)
    assert after.keys() == expected.keys()
    different = [k for k in expected if not torch.equal(after[k], expected[k])]
    assert different == []


@pytest.fixture
def two_checkpoints(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Checkpoints of steps 3 and 4 under tmp_path/ckpt, and the tensors each holds."""
    root = tmp_path / "ckpt"
    model, opt = _model(seed=0)
    _train_step(model, opt)
    state3 = _trainer_state(3)
    snap3 = _snapshot(model, opt, state3)
    save(root, 3, [model], [opt], state3, keep=3)
    _train_step(model, opt)
    state4 = _trainer_state(4)
    snap4 = _snapshot(model, opt, state4)
    save(root, 4, [model], [opt], state4, keep=3)
    return root, snap3, snap4


def test_manifest_lists_every_file_with_size_and_sha256(two_checkpoints):
    root, _, snap4 = two_checkpoints
    path = root / "step-0000004"
    manifest = json.loads((path / MANIFEST).read_text())
    assert (manifest["format"], manifest["version"], manifest["step"], manifest["world_size"]) == (
        "gridtrain-checkpoint", 1, 4, 1)
    assert manifest["created"].endswith("+00:00")
    files = sorted(p.name for p in path.iterdir() if p.name != MANIFEST)
    assert files == [".metadata", SHARD]
    assert sorted(manifest["files"]) == files
    for name in files:
        data = (path / name).read_bytes()
        assert manifest["files"][name] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify(path) is None
    assert sorted(p.name for p in root.iterdir()) == ["step-0000003", "step-0000004"]  # no .tmp
    _assert_restores(path, snap4)


def _truncate(path: Path) -> str:
    shard = path / SHARD
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    return f"shard {SHARD} is {size // 2:,} bytes, the manifest says {size:,} (truncated)"


def _flip_byte(path: Path) -> str:
    shard = path / SHARD
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(data)
    return f"shard {SHARD} has sha256 "


def _flip_metadata_byte(path: Path) -> str:
    meta = path / ".metadata"
    data = bytearray(meta.read_bytes())
    data[-5] ^= 0x80
    meta.write_bytes(data)
    return "file .metadata has sha256 "


def _delete_manifest(path: Path) -> str:
    (path / MANIFEST).unlink()
    return "no manifest.json (the save did not finish"


def _delete_shard(path: Path) -> str:
    size = (path / SHARD).stat().st_size
    (path / SHARD).unlink()
    return f"shard {SHARD} is missing (the manifest lists {size:,} bytes)"


def _extra_shard(path: Path) -> str:
    shutil.copy(path / SHARD, path / "__1_0.distcp")
    return "shard __1_0.distcp is not in the manifest"


def _bad_json(path: Path) -> str:
    (path / MANIFEST).write_text('{"format": "gridtrain-checkpoint", "files": ')
    return "manifest.json is not valid JSON ("


def _wrong_step(path: Path) -> str:
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["step"] = 3
    (path / MANIFEST).write_text(json.dumps(manifest))
    return "manifest.json is for step 3, but the directory is step-0000004"


@pytest.mark.parametrize("corrupt", [_truncate, _flip_byte, _flip_metadata_byte, _delete_manifest,
                                     _delete_shard, _extra_shard, _bad_json, _wrong_step])
def test_corrupt_newest_is_skipped_and_previous_restores_exactly(two_checkpoints, corrupt, caplog):
    root, snap3, _ = two_checkpoints
    newest = root / "step-0000004"
    assert verify(newest) is None  # also fills the verify cache: corruption must invalidate it
    fragment = corrupt(newest)
    reason = verify(newest)
    assert reason is not None and fragment in reason
    caplog.set_level(logging.WARNING, logger="gridtrain.checkpoint.store")
    chosen, skipped = latest_valid_checkpoint(root)
    assert chosen == root / "step-0000003"
    assert [p for p, _ in skipped] == [newest] and fragment in skipped[0][1]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("checkpoint step-0000004 skipped: ")
    assert fragment in warnings[0]
    assert checkpoint.latest_checkpoint(root) == chosen
    model, opt = _model(seed=5)
    with pytest.raises(InvalidCheckpointError, match="refusing to load checkpoint .*step-0000004") as err:
        load(newest, [model], [opt], _trainer_state(0))
    assert fragment in str(err.value)
    _assert_restores(chosen, snap3)


def test_no_valid_checkpoint_gives_none_and_every_reason(two_checkpoints):
    root, _, _ = two_checkpoints
    _delete_manifest(root / "step-0000004")
    fragment3 = _truncate(root / "step-0000003")
    chosen, skipped = latest_valid_checkpoint(root)
    assert chosen is None
    assert [p.name for p, _ in skipped] == ["step-0000004", "step-0000003"]
    assert skipped[0][1].startswith("no manifest.json") and fragment3 in skipped[1][1]
    assert latest_valid_checkpoint(root / "nowhere") == (None, [])


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("spec, stage, os_text, fix", [
    ("ENOSPC", "writing shards", "No space left on device", "free space on the filesystem of "),
    ("ENOSPC:prepare", "prepare", "No space left on device", "free space on the filesystem of "),
    ("ENOSPC:manifest", "commit (manifest and rename)", "No space left on device", "bytes free now"),
    ("EACCES:manifest", "commit (manifest and rename)", "Permission denied", "writable by this user"),
])
def test_failed_save_raises_and_loses_nothing(two_checkpoints, monkeypatch, spec, stage, os_text, fix):
    root, _, snap4 = two_checkpoints
    monkeypatch.setenv(FAULT_ENV, spec)
    model, opt = _model(seed=1)
    with pytest.raises(CheckpointSaveError) as err:
        save(root, 5, [model], [opt], _trainer_state(5), keep=1)  # keep=1: pruning must not run
    message = str(err.value)
    assert f"checkpoint of step 5 not saved to {root / 'step-0000005.tmp'} ({stage} failed: " in message
    assert os_text in message and f"injected by {FAULT_ENV}" in message
    assert f"earlier checkpoints in {root} are untouched. Fix: " in message and fix in message
    assert "set checkpoint.dir to " in message
    assert _leftovers(root) == ["step-0000003", "step-0000004"]
    assert latest_valid_checkpoint(root) == (root / "step-0000004", [])
    _assert_restores(root / "step-0000004", snap4)
    monkeypatch.delenv(FAULT_ENV)
    save(root, 5, [model], [opt], _trainer_state(5), keep=1)
    assert _leftovers(root) == ["step-0000005"]


def test_fault_hook_rejects_unknown_errno(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "ENOTANERROR:prepare")
    model, opt = _model(seed=1)
    with pytest.raises(CheckpointSaveError, match="'ENOTANERROR' is not an errno name") as err:
        save(tmp_path, 1, [model], [opt], _trainer_state(1), keep=1)
    assert "Fix: see the chained exception (not a filesystem error)" in str(err.value)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (needs root and CAP_SYS_ADMIN; skipped otherwise)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                              capture_output=True, text=True, check=False)
    except FileNotFoundError:
        pytest.skip("no mount command")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _toy() -> tuple[nn.Linear, torch.optim.AdamW]:
    torch.manual_seed(0)
    toy = nn.Linear(3, 2)
    opt = torch.optim.AdamW(toy.parameters(), lr=0.1)
    toy(torch.randn(4, 3)).sum().backward()
    opt.step()
    return toy, opt


def _assert_toy_restores(path: Path, toy: nn.Linear, opt: torch.optim.Optimizer) -> None:
    other = nn.Linear(3, 2)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    state = load(path, [other], [other_opt], {"step": torch.tensor(0)})
    assert int(state["step"]) == 1
    assert torch.equal(other.weight, toy.weight) and torch.equal(other.bias, toy.bias)
    assert torch.equal(other_opt.state[other.weight]["exp_avg"], opt.state[toy.weight]["exp_avg"])


def test_full_filesystem_fails_cleanly(small_tmpfs):
    root = small_tmpfs / "ckpt"
    toy, toy_opt = _toy()
    first = save(root, 1, [toy], [toy_opt], {"step": torch.tensor(1)}, keep=1)
    model, opt = _model(seed=0)  # ~0.5 MB of weights, 1.5 MB with AdamW: far over 64 KiB
    _train_step(model, opt)
    with pytest.raises(CheckpointSaveError) as err:
        save(root, 2, [model], [opt], _trainer_state(2), keep=1)
    message = str(err.value)
    assert "(writing shards failed: [Errno 28] No space left on device" in message
    assert f"free space on the filesystem of {root} (" in message and "bytes free now" in message
    assert isinstance(err.value.__cause__, BaseException)
    assert _leftovers(root) == ["step-0000001"]
    assert verify(first) is None
    _assert_toy_restores(first, toy, toy_opt)


def test_read_only_filesystem_fails_cleanly(small_tmpfs):
    root = small_tmpfs / "ckpt"
    toy, toy_opt = _toy()
    first = save(root, 1, [toy], [toy_opt], {"step": torch.tensor(1)}, keep=1)
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    with pytest.raises(CheckpointSaveError) as err:
        save(root, 2, [toy], [toy_opt], {"step": torch.tensor(2)}, keep=1)
    assert "(prepare failed: [Errno 30] Read-only file system" in str(err.value)
    assert f"Fix: remount {root} read-write or set checkpoint.dir" in str(err.value)
    assert _leftovers(root) == ["step-0000001"]
    _assert_toy_restores(first, toy, toy_opt)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_permission_denied_fails_cleanly(tmp_path):
    root = tmp_path / "ckpt"
    toy, toy_opt = _toy()
    first = save(root, 1, [toy], [toy_opt], {"step": torch.tensor(1)}, keep=1)
    root.chmod(0o500)
    try:
        with pytest.raises(CheckpointSaveError) as err:
            save(root, 2, [toy], [toy_opt], {"step": torch.tensor(2)}, keep=1)
    finally:
        root.chmod(0o700)
    assert "(prepare failed: [Errno 13] Permission denied" in str(err.value)
    assert f"make {root} writable by this user" in str(err.value)
    assert _leftovers(root) == ["step-0000001"]
    _assert_toy_restores(first, toy, toy_opt)


def test_keep_k_keeps_exactly_k_and_never_the_newest_valid(tmp_path):
    root = tmp_path / "ckpt"
    toy, opt = _toy()
    for step in range(1, 6):
        save(root, step, [toy], [opt], {"step": torch.tensor(step)}, keep=2)
    assert _leftovers(root) == ["step-0000004", "step-0000005"]
    # A corrupt checkpoint does not count towards K: the intact step 4 survives two more saves.
    _truncate_any(root / "step-0000005")
    save(root, 6, [toy], [opt], {"step": torch.tensor(6)}, keep=2)
    assert _leftovers(root) == ["step-0000004", "step-0000005", "step-0000006"]
    save(root, 7, [toy], [opt], {"step": torch.tensor(7)}, keep=2)
    assert _leftovers(root) == ["step-0000006", "step-0000007"]
    # Checkpoints newer than the one just saved (an earlier run went further) are never deleted.
    save(root, 3, [toy], [opt], {"step": torch.tensor(3)}, keep=1)
    assert _leftovers(root) == ["step-0000003", "step-0000006", "step-0000007"]
    assert checkpoint.prune(root, 7, keep=0) == []
    # Saving a step that exists replaces it only once the new one is complete, leaving nothing aside.
    _truncate_any(root / "step-0000007")
    save(root, 7, [toy], [opt], {"step": torch.tensor(7)}, keep=3)
    assert _leftovers(root) == ["step-0000003", "step-0000006", "step-0000007"]
    assert verify(root / "step-0000007") is None



def test_commit_removes_what_crashed_earlier_saves_left(tmp_path):
    """A kill mid-save leaves step-NNNNNNN.tmp (or .replaced) behind: the next commit of a later
    step removes those of earlier steps and leaves a later step's alone."""
    root = tmp_path / "ckpt"
    toy, opt = _toy()
    for name in ("step-0000002.tmp", "step-0000003.replaced", "step-0000009.tmp"):
        (root / name).mkdir(parents=True)
        (root / name / "__0_0.distcp").write_bytes(b"partial")
    save(root, 4, [toy], [opt], {"step": torch.tensor(4)}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-0000004", "step-0000009.tmp"]


def _truncate_any(path: Path) -> None:
    shard = next(path.glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(10)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_async_save_commits_later_and_keeps_the_staged_state(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    model, opt = _model(seed=0)
    _train_step(model, opt)
    snap = _snapshot(model, opt, _trainer_state(1))
    saver = AsyncSaver(root, keep=2)
    saver.save(1, [model], [opt], _trainer_state(1))
    _train_step(model, opt)  # training goes on while the checkpoint is written
    assert not (root / "step-0000001").exists()  # not committed before wait() or the next save
    saver.save(2, [model], [opt], _trainer_state(2))
    assert verify(root / "step-0000001") is None
    assert saver.wait() == root / "step-0000002"
    assert saver.wait() is None
    _assert_restores(root / "step-0000001", snap)
    monkeypatch.setenv(FAULT_ENV, "ENOSPC")
    saver.save(3, [model], [opt], _trainer_state(3))  # fails in the background ...
    with pytest.raises(CheckpointSaveError, match=r"step 3 not saved .*\(writing shards failed: "
                                                  r"\[Errno 28\] No space left on device"):
        saver.wait()  # ... and is reported here
    assert _leftovers(root) == ["step-0000001", "step-0000002"]
    assert latest_valid_checkpoint(root) == (root / "step-0000002", [])


# -- two processes on gloo: every rank learns of a failure on any rank, and all choose alike -----

def _outcome(fn) -> str:  # type: ignore[no-untyped-def]
    try:
        fn()
    except (CheckpointSaveError, InvalidCheckpointError) as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def _two_rank_worker(rank: int, root: str, port: int, out: str) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    root_path, toy, opt = Path(root), *_toy()
    state = {"step": torch.tensor(1)}
    results: dict[str, object] = {}

    def faulty(spec: str, step: int):  # type: ignore[no-untyped-def]
        os.environ[FAULT_ENV] = spec
        try:
            return _outcome(lambda: save(root_path, step, [toy], [opt], state, keep=1))
        finally:
            del os.environ[FAULT_ENV]

    results["first"] = _outcome(lambda: save(root_path, 1, [toy], [opt], state, keep=1))
    results["shards@1"] = faulty("ENOSPC@1", 2)
    results["manifest@0"] = faulty("ENOSPC:manifest", 2)
    results["prepare"] = faulty("EACCES:prepare", 2)
    results["after_failures"] = sorted(p.name for p in root_path.iterdir())
    save(root_path, 2, [toy], [opt], state, keep=3)
    if rank == 0:
        _truncate_any(root_path / "step-0000002")
    dist.barrier()
    chosen, skipped = latest_valid_checkpoint(root_path)
    results["chosen"] = chosen.name if chosen else None
    results["skipped"] = [(p.name, r) for p, r in skipped]
    results["load_corrupt"] = _outcome(lambda: load(root_path / "step-0000002", [toy], [opt], state))
    results["load_good"] = _outcome(lambda: load(root_path / "step-0000001", [toy], [opt], state))
    saver = AsyncSaver(root_path, keep=3)
    saver.save(3, [toy], [opt], state)
    results["async_ok"] = _outcome(saver.wait)
    os.environ[FAULT_ENV] = "ENOSPC@1"
    saver.save(4, [toy], [opt], state)
    results["async_fail"] = _outcome(saver.wait)
    del os.environ[FAULT_ENV]
    results["final"] = sorted(p.name for p in root_path.iterdir())
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_ranks_agree_on_failures_and_on_the_checkpoint(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = tmp_path / "ckpt"
    mp.spawn(_two_rank_worker, args=(str(root), port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["first"] == r1["first"] == "ok"
    for key, cause in [("shards@1", "(writing shards failed: [Errno 28] No space left on device"),
                       ("manifest@0", "(commit (manifest and rename) failed: [Errno 28] No space"),
                       ("prepare", "(prepare failed: [Errno 13] Permission denied")]:
        assert r0[key].startswith("CheckpointSaveError: checkpoint of step 2 not saved") and cause in r0[key]
        assert r1[key].startswith("CheckpointSaveError: checkpoint of step 2 not saved")
    assert "on rank 1" in r0["shards@1"] and "on rank 1" in r1["shards@1"]
    assert "a failure on another rank (rank 0's log names it)" in r1["manifest@0"]
    assert r0["after_failures"] == ["step-0000001"]
    assert r0["chosen"] == r1["chosen"] == "step-0000001"
    assert [name for name, _ in r0["skipped"]] == [name for name, _ in r1["skipped"]] == ["step-0000002"]
    assert "(truncated)" in r0["skipped"][0][1]
    assert r1["skipped"][0][1].startswith("failed verification on rank 0")
    assert r0["load_corrupt"].startswith("InvalidCheckpointError: refusing to load checkpoint")
    assert "(truncated)" in r0["load_corrupt"]
    assert r1["load_corrupt"].startswith("InvalidCheckpointError: refusing to load checkpoint")
    assert r0["load_good"] == r1["load_good"] == "ok"
    assert r0["async_ok"] == r1["async_ok"] == "ok"
    for r in (r0, r1):
        assert "step 4 not saved" in r["async_fail"] and "No space left on device" in r["async_fail"]
    assert r0["final"] == r1["final"] == ["step-0000001", "step-0000002", "step-0000003"]
    assert verify(root / "step-0000003") is None
    manifest = json.loads((root / "step-0000003" / MANIFEST).read_text())
    assert manifest["world_size"] == 2
