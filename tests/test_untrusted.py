"""A checkpoint from someone else never runs their code: a `.metadata` whose pickle would create a
file (its manifest updated to match, as its author could) is refused by export and by resume, in
one line, and the file is never created. A genuine checkpoint still loads."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from conftest import cli_train

from gridtrain.cli import main
from gridtrain.train.manifest import write_manifest


class Payload:
    """Unpickling this calls open(target, 'w'): a file appears if anything unpickles it."""

    def __init__(self, target: Path) -> None:
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.fixture
def crafted(tmp_path, corpus_dir) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    assert cli_train(run_dir, corpus_dir) == 0
    ckpt = run_dir / "checkpoints" / "step-0000002"
    mark = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(mark)))
    write_manifest(ckpt, 2, 1)  # the author's checksums match their files
    return run_dir, mark


def test_export_refuses_a_crafted_checkpoint_without_running_it(crafted, tmp_path, capsys):
    run_dir, mark = crafted
    assert main(["export", str(run_dir), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "io.open, which no DCP checkpoint holds" in err and "Traceback" not in err
    assert not mark.exists()
    assert not (tmp_path / "hf").exists()


def test_resume_refuses_a_crafted_checkpoint_without_running_it(crafted, corpus_dir, capsys):
    run_dir, mark = crafted
    assert cli_train(run_dir, corpus_dir, "--resume", "--train.steps", "4") == 1
    err = capsys.readouterr().err
    assert "io.open, which no DCP checkpoint holds" in err and "Traceback" not in err
    assert not mark.exists()


def test_a_genuine_checkpoint_passes_the_safe_reader(tmp_path, corpus_dir):
    from gridtrain.train.untrusted import SafeReader

    run_dir = tmp_path / "run"
    assert cli_train(run_dir, corpus_dir) == 0
    metadata = SafeReader(run_dir / "checkpoints" / "step-0000002").read_metadata()
    assert "model.tok_embeddings.weight" in metadata.state_dict_metadata
    assert main(["export", str(run_dir), str(tmp_path / "hf")]) == 0
