"""A checkpoint from someone else never runs their code, never makes gridtrain read outside its
directory, and never escapes the one-line boundary.

Each route is crafted here on a genuine checkpoint, as its author could, with the manifest
regenerated to match (checksums are not a signature):
- a pickled bytes item in a shard (how DCP stores a value that is not a tensor; DCP's own load
  planner unpickles it with torch.load(weights_only=False));
- a weight re-marked as a bytes item in `.metadata` (only DCP's own classes in the pickle);
- a weight read from a file outside the checkpoint directory (`../../notes.bin`);
- a `.metadata` whose pickle names a class DCP never writes (`io.open`);
the damaged metadata that used to escape as a 50-line traceback (truncated, `None`, a size of
2**40, a missing key, a `relative_path` of /dev/zero, a storage_meta of another type); and what a
second reader of this code found: a `.metadata` nesting a tuple 100,000 deep (it crashed the
interpreter), a tensor stored compressed (a zip bomb), chunks that leave a tensor uninitialized,
and a shard that is a link to a file outside the directory. Every reader of checkpoints (resume,
export, sample, eval) refuses each in one line with exit status 2, and the file the payload
would create never appears. `plan --check` and the explorer's runs view read no checkpoint.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from conftest import cli_train

from gridtrain.cli import main
from gridtrain.checkpoint.manifest import write_manifest
from gridtrain.checkpoint.untrusted import MetadataUnpickler

STEP = "step-0000002"


class Payload:
    """Unpickling this calls open(target, 'w'): a file appears if anything unpickles it."""

    def __init__(self, target: Path) -> None:
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.fixture(scope="module")
def genuine(tmp_path_factory, corpus_dir) -> Path:
    """A tiny run with its checkpoint of step 2 (written once for the module)."""
    run_dir = tmp_path_factory.mktemp("genuine") / "run"
    assert cli_train(run_dir, corpus_dir, "--train.sample_tokens", "0") == 0
    return run_dir


def read_metadata(ckpt: Path):
    with open(ckpt / ".metadata", "rb") as f:
        return MetadataUnpickler(f).load()


def rewrite(ckpt: Path, metadata) -> None:
    """Write `.metadata` back and regenerate the manifest, as the checkpoint's author could."""
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    write_manifest(ckpt, 2, 1)


def payload_bytes(mark: Path) -> bytes:
    buf = io.BytesIO()
    torch.save(Payload(mark), buf)  # as DCP writes a bytes item
    return buf.getvalue()


def as_bytes_item(ckpt: Path, key: str, mark: Path, file: str) -> None:
    """Mark `key` a bytes item whose bytes (the payload) are appended to `file`, relative to the
    checkpoint directory."""
    target = (ckpt / file).resolve()
    offset = target.stat().st_size if target.exists() else 0
    data = payload_bytes(mark)
    with open(target, "ab") as f:
        f.write(data)
    metadata = read_metadata(ckpt)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn != key}
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(file, offset, len(data))
    rewrite(ckpt, metadata)


def scalar_key(ckpt: Path) -> str:
    return next(k for k in read_metadata(ckpt).state_dict_metadata if k.startswith("optim.param_groups."))


def craft_bytes_in_shard(ckpt, mark):
    as_bytes_item(ckpt, scalar_key(ckpt), mark, "__0_0.distcp")


def craft_weight_as_bytes(ckpt, mark):
    as_bytes_item(ckpt, "model.norm.weight", mark, "__0_0.distcp")


def craft_outside_path(ckpt, mark):
    """The norm weight's tensor read from a copy outside the directory, where no manifest reaches."""
    metadata = read_metadata(ckpt)
    index = next(i for i in metadata.storage_data if i.fqn == "model.norm.weight")
    info = metadata.storage_data[index]
    with open(ckpt / info.relative_path, "rb") as f:
        f.seek(info.offset)
        (ckpt / "../../notes.bin").write_bytes(f.read(info.length))
    metadata.storage_data[index] = _StorageInfo("../../notes.bin", 0, info.length)
    rewrite(ckpt, metadata)


def craft_disallowed_class(ckpt, mark):
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(mark)))
    write_manifest(ckpt, 2, 1)


def craft_truncated(ckpt, mark):
    data = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(data[:len(data) // 2])
    write_manifest(ckpt, 2, 1)


def craft_none(ckpt, mark):
    (ckpt / ".metadata").write_bytes(pickle.dumps(None))
    write_manifest(ckpt, 2, 1)


def craft_huge_size(ckpt, mark):
    metadata = read_metadata(ckpt)
    item = metadata.state_dict_metadata["model.norm.weight"]
    item.size = item.chunks[0].sizes = torch.Size([2**40])  # a tensor and its one chunk, 2**40 elements
    rewrite(ckpt, metadata)


def craft_missing_key(ckpt, mark):
    metadata = read_metadata(ckpt)
    del metadata.state_dict_metadata["model.norm.weight"]
    metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn != "model.norm.weight"}
    rewrite(ckpt, metadata)


def craft_dev_zero(ckpt, mark):
    metadata = read_metadata(ckpt)
    index = next(i for i in metadata.storage_data if i.fqn == "model.norm.weight")
    metadata.storage_data[index] = _StorageInfo("/dev/zero", 0, 2**40)
    rewrite(ckpt, metadata)


def craft_deep_nesting(ckpt, mark):
    """A tuple nested 100,000 deep as a dict key: hashing it crashed the interpreter (SIGSEGV)."""
    (ckpt / ".metadata").write_bytes(b"\x80\x04}" + b")" + b"\x85" * 100_000 + b"Ns.")
    write_manifest(ckpt, 2, 1)


def craft_compressed(ckpt, mark):
    """The norm weight's bytes recompressed: torch.save never compresses, so a compressed entry can
    only inflate (a 3.9 MB item declared 4 GB and took 4.2 GB to refuse)."""
    import zipfile

    metadata = read_metadata(ckpt)
    index = next(i for i in metadata.storage_data if i.fqn == "model.norm.weight")
    info = metadata.storage_data[index]
    with open(ckpt / info.relative_path, "rb") as f:
        f.seek(info.offset)
        blob = f.read(info.length)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(blob)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for entry in src.infolist():
            dst.writestr(entry.filename, src.read(entry))
    shard = ckpt / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(out.getvalue())
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(out.getvalue()))
    rewrite(ckpt, metadata)


def craft_no_chunks(ckpt, mark):
    """A tensor whose chunks cover none of it: a load left it uninitialized, and exited 0."""
    metadata = read_metadata(ckpt)
    metadata.state_dict_metadata["model.norm.weight"].chunks = []
    rewrite(ckpt, metadata)


def craft_storage_meta(ckpt, mark):
    metadata = read_metadata(ckpt)
    metadata.storage_meta = 1
    rewrite(ckpt, metadata)


def craft_symlinked_shard(ckpt, mark):
    """The shard a link to a copy outside the directory (its checksum the manifest's)."""
    outside = ckpt.parent.parent.parent / "shard-copy"
    shutil.copy(ckpt / "__0_0.distcp", outside)
    (ckpt / "__0_0.distcp").unlink()
    (ckpt / "__0_0.distcp").symlink_to(outside)


ROUTES = {  # route: (craft, words of the refusal)
    "bytes item in a shard": (craft_bytes_in_shard, "as a pickled bytes item"),
    "weight re-marked as bytes": (craft_weight_as_bytes, "marks 'model.norm.weight' as a pickled bytes item"),
    "relative_path outside": (craft_outside_path, "from '../../notes.bin', which is not a file of the checkpoint's"),
    "disallowed class": (craft_disallowed_class, "io.open, which no DCP checkpoint holds"),
    "truncated metadata": (craft_truncated, "its .metadata cannot be read"),
    "None metadata": (craft_none, "its .metadata holds a NoneType, not DCP's Metadata"),
    "size 2**40": (craft_huge_size, "model.norm.weight is [1099511627776] there, [64] here"),
    "missing key": (craft_missing_key, "model.norm.weight is missing"),
    "relative_path /dev/zero": (craft_dev_zero, "from '/dev/zero', which is not a file of the checkpoint's manifest"),
    "deep nesting": (craft_deep_nesting, "its .metadata nests objects more than 64 deep"),
    "compressed tensor": (craft_compressed, "holds 'model.norm.weight' compressed"),
    "chunks short of the tensor": (craft_no_chunks, "chunks of 'model.norm.weight' hold 0 elements, the tensor has 64"),
    "storage_meta of another type": (craft_storage_meta, "its .metadata's storage_meta is a int"),
    "symlinked shard": (craft_symlinked_shard, "shard __0_0.distcp is not a regular file (a link"),
}


def reader_argv(reader: str, run_dir: Path, out: Path, corpus_dir: Path) -> list[str] | None:
    return {
        "export": ["export", str(run_dir), str(out)],
        "sample": ["sample", str(run_dir), "--max-new-tokens", "4"],
        "eval": ["eval", str(run_dir), "--batches", "1"],
        "plan --check": ["plan", "--check", str(run_dir)],
    }.get(reader)


@pytest.mark.parametrize("reader", ["resume", "export", "sample", "eval"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_every_reader_refuses_every_route_in_one_line(genuine, corpus_dir, tmp_path, route, reader, capsys):
    run_dir = tmp_path / "deep" / "run"
    shutil.copytree(genuine, run_dir)
    ckpt = run_dir / "checkpoints" / STEP
    mark = tmp_path / "pwned"
    craft, words = ROUTES[route]
    craft(ckpt, mark)
    capsys.readouterr()
    if reader == "resume":
        code = cli_train(run_dir, corpus_dir, "--resume", "--train.steps", "4", "--train.sample_tokens", "0")
    else:
        code = main(reader_argv(reader, run_dir, tmp_path / "out", corpus_dir))
    out, err = capsys.readouterr()
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("gridtrain:")]
    assert len(lines) == 1 and words in lines[0], err
    assert "Traceback" not in err
    assert not mark.exists()
    assert not (tmp_path / "out").exists()


def test_resume_refuses_a_checkpoint_whose_state_is_not_its_step(genuine, corpus_dir, tmp_path, capsys):
    """step-0000002 renamed step-0000004 with a manifest to match: resume would have trained on
    from the state of step 2 as if it were step 4 (a step of 10**12 trained nothing and exited 0)."""
    run_dir = tmp_path / "run"
    shutil.copytree(genuine, run_dir)
    moved = run_dir / "checkpoints" / "step-0000004"
    (run_dir / "checkpoints" / STEP).rename(moved)
    write_manifest(moved, 4, 1)
    assert cli_train(run_dir, corpus_dir, "--resume", "--train.steps", "6", "--train.sample_tokens", "0") == 2
    assert "holds the state of step 2, not of the step its name says" in capsys.readouterr().err


def test_readers_of_no_checkpoint_never_touch_a_crafted_one(genuine, tmp_path, capsys):
    """plan --check and the explorer's runs view read config.json and metrics.jsonl only."""
    from gridtrain.explore import runs

    run_dir = tmp_path / "runs" / "run"
    shutil.copytree(genuine, run_dir)
    mark = tmp_path / "pwned"
    craft_weight_as_bytes(run_dir / "checkpoints" / STEP, mark)
    assert main(["plan", "--check", str(run_dir)]) == 0
    status, listing = runs.run_list(tmp_path / "runs")
    assert status == 200 and [r["name"] for r in listing["runs"]] == ["run"]
    assert not mark.exists()


def test_a_genuine_checkpoint_holds_no_pickled_item_and_resumes(genuine, corpus_dir, tmp_path):
    """gridtrain's own checkpoints store the optimizer's lr, betas, eps and weight decay as tensors:
    no bytes item at all, and a resume restores them."""
    from gridtrain.checkpoint.untrusted import SafeReader

    metadata = SafeReader(genuine / "checkpoints" / STEP).read_metadata()
    kinds = {type(item).__name__ for item in metadata.state_dict_metadata.values()}
    assert kinds == {"TensorStorageMetadata"}
    assert "optim.param_groups.layers.0.attention.wq.weight.betas" in metadata.state_dict_metadata
    run_dir = tmp_path / "run"
    shutil.copytree(genuine, run_dir)
    assert cli_train(run_dir, corpus_dir, "--resume", "--train.steps", "3", "--train.sample_tokens", "0") == 0
    assert main(["export", str(run_dir), str(tmp_path / "hf")]) == 0


def test_optimizer_settings_round_trip_as_tensors():
    """The param groups' numbers come back in their own types; the switches from the live optimizer."""
    from gridtrain.checkpoint.state import settings_as_tensors, settings_from_tensors

    live = {"state.w.step": torch.tensor(3.0), "param_groups.w.lr": 0.002, "param_groups.w.betas": (0.9, 0.95),
            "param_groups.w.foreach": None, "param_groups.w.maximize": False, "param_groups.w.weight_decay": 0.1}
    stored = settings_as_tensors(live)
    assert set(stored) == {"state.w.step", "param_groups.w.lr", "param_groups.w.betas", "param_groups.w.weight_decay"}
    assert all(isinstance(v, torch.Tensor) for v in stored.values())
    stored["param_groups.w.lr"] = torch.tensor(0.5, dtype=torch.float64)  # what the checkpoint held
    back = settings_from_tensors(stored, live)
    assert back["param_groups.w.lr"] == 0.5 and type(back["param_groups.w.lr"]) is float
    assert back["param_groups.w.betas"] == (0.9, 0.95) and type(back["param_groups.w.betas"]) is tuple
    assert back["param_groups.w.foreach"] is None and back["param_groups.w.maximize"] is False


CONFIGS = {  # a run's config.json edited by hand or by someone else: (key, value, words)
    "a million layers": ("n_layers", 1_000_000, "model.n_layers = 1,000,000 is past 10,000 blocks"),
    "more layers than held": ("n_layers", 9_000, "it holds 2 layers, the run's config.json says model.n_layers = 9,000"),
    "vocab 1e12": ("vocab_size", 10**12, "makes a weight of 64,000,000,000,000 elements"),
    "dim 1048576": ("dim", 1_048_576, "its embedding is [320, 64], the run's config.json says vocab_size x dim = [320, 1,048,576]"),
    "context 1e12": ("max_seq_len", 10**12, "the rotary table, model.max_seq_len (1,000,000,000,000)"),
    "a count as a string": ("n_layers", "two", "model.n_layers = 'two' is not a valid int"),
}


@pytest.mark.parametrize("reader", ["export", "sample", "eval"])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_crafted_run_config_is_refused_before_anything_is_built(genuine, tmp_path, case, reader, capsys):
    """The run's config.json is compared with the checkpoint's shapes (layer count and embedding
    first) before a model is built from it: what used to hang for minutes or ask for terabytes is
    one line, exit 2, at once."""
    import json
    import time

    run_dir = tmp_path / "run"
    shutil.copytree(genuine, run_dir)
    key, value, words = CONFIGS[case]
    record = json.loads((run_dir / "config.json").read_text())
    record["config"]["model"][key] = value
    (run_dir / "config.json").write_text(json.dumps(record))
    capsys.readouterr()
    start = time.perf_counter()
    code = main(reader_argv(reader, run_dir, tmp_path / "out", tmp_path))
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and words in lines[0], err
    assert elapsed < 5, elapsed
    assert not (tmp_path / "out").exists()


class _Payload:
    """What a crafted pickle would call on load."""

    def __reduce__(self):
        return (os.system, ("echo owned > /dev/null",))


def test_a_rejoining_replica_group_runs_no_pickle_from_its_peer(tmp_path):
    """torchft's HTTP transport loads a peer's state with weights_only=False; gridtrain's receives
    tensors, numbers and containers, and refuses a pickled callable."""
    pytest.importorskip("torchft")
    from datetime import timedelta

    from gridtrain.train.ft import safe_transport

    transport = safe_transport(timedelta(seconds=5))
    try:
        good, bad = tmp_path / "good", tmp_path / "bad"
        state = {"user": {"model": {"w": torch.ones(3)}, "step": 7, "rng": torch.get_rng_state()}, "torchft": {"step": 7}}
        from torch.distributed._serialization import _streaming_save  # the format the transport sends

        for path, obj in ((good, state), (bad, {"user": _Payload()})):
            with open(path, "wb") as f:
                _streaming_save(obj, f)
        loaded = transport._load_from_address(good.as_uri(), timedelta(seconds=5))
        assert loaded["user"]["step"] == 7 and torch.equal(loaded["user"]["model"]["w"], torch.ones(3))
        with pytest.raises(pickle.UnpicklingError):
            transport._load_from_address(bad.as_uri(), timedelta(seconds=5))
    finally:
        transport.shutdown()
