"""Files the user names are checked before they are read: a directory, a device, a fifo or a
file past the bound is one line and exit status 2, never a hang (gridtrain.inputs). The table of
tests/test_bad_inputs.py holds the small cases; the huge files are here, since its harness hashes
every file of its inputs (these are sparse: they cost no disk and are never read)."""

import os

import pytest

from gridtrain.cli import main
from gridtrain.cli_inference import PROMPT_FILE_BYTES
from gridtrain.data.tokenizer import TOKENIZER_FILE_BYTES
from gridtrain.errors import BadInput, MissingInput
from gridtrain.inputs import read_input


def sparse(path, size: int):
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_read_input_refuses_what_is_not_a_bounded_regular_file(tmp_path):
    (tmp_path / "small").write_bytes(b"abc")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero").symlink_to("/dev/zero")
    sparse(tmp_path / "big", 1 << 30)
    assert read_input(tmp_path / "small", "f", 3) == b"abc"
    device = "is not a regular file (a device, a pipe or a socket)"
    for name, why in [("fifo", device), ("zero", device),
                      (".", "is a directory, not a file"), ("small/x", "does not exist"),
                      ("big", "is 1 GiB (1,073,741,824 bytes), more than the 1 KiB read from it")]:
        with pytest.raises(BadInput if name != "small/x" else MissingInput) as refused:
            read_input(tmp_path / name, f"--x {name}", 1024)
        assert str(refused.value) == f"--x {name} {why}"
    with pytest.raises(BadInput, match="is 3 bytes, more than the 2 bytes read from it"):
        read_input(tmp_path / "small", "f", 2)


@pytest.mark.parametrize("argv, words", [
    (["sample", "{d}/no-run", "--prompt-file", "{d}/huge.txt"],  # refused before the run is looked at
     f"--prompt-file {{d}}/huge.txt is 16 MiB ({PROMPT_FILE_BYTES + 1:,} bytes), more than the 16 MiB read from it"),
    (["data", "prepare", "--tokenizer", "{d}/huge.json", "--out", "{d}/out"],
     f"--tokenizer = '{{d}}/huge.json' is 256 MiB ({TOKENIZER_FILE_BYTES + 1:,} bytes), more than the 256 MiB"),
    (["train", "--data.tokenizer", "{d}/huge.json", "--run_dir", "{d}/run"],
     f"data.tokenizer = '{{d}}/huge.json' is 256 MiB ({TOKENIZER_FILE_BYTES + 1:,} bytes), more than"),
])
def test_a_huge_file_is_refused_by_its_size(tmp_path, capsys, monkeypatch, argv, words):
    sparse(tmp_path / "huge.txt", PROMPT_FILE_BYTES + 1)
    sparse(tmp_path / "huge.json", TOKENIZER_FILE_BYTES + 1)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    before = sorted(tmp_path.rglob("*"))
    assert main([a.replace("{d}", str(tmp_path)) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and words.replace("{d}", str(tmp_path)) in err, err
    assert sorted(tmp_path.rglob("*")) == before


def test_a_corpus_folder_reads_its_regular_files_only(tmp_path):
    """A text file that links to /dev/zero (21.8 GB before the kernel killed the run) or is a fifo
    (train hung) is skipped like any file that is not text, and said once."""
    from gridtrain.data.corpus import iter_documents

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("a real document\n")
    (corpus / "zero.txt").symlink_to("/dev/zero")
    os.mkfifo(corpus / "pipe.txt")
    assert list(iter_documents(corpus)) == ["a real document\n"]
