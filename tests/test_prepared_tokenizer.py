"""A prepared folder (`gridtrain data prepare`'s) names the tokenizer it was tokenized with: a run
on it with another data.tokenizer is refused before launch, in one line, since its samples and
evaluations would decode the run's tokens as other text."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models

from gridtrain.config import ConfigError
from gridtrain.data.shards import load_index, prepare
from gridtrain.data.tokenizer import BPETokenizer, ByteTokenizer
from gridtrain.validate import validate


def _word_tokenizer(path, words):
    vocab = {"<eos>": 0, "<unk>": 1} | {w: i + 2 for i, w in enumerate(words)}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(path))
    return path


@pytest.fixture
def folders(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"d{i}.txt").write_text(f"alpha beta gamma {i}\n" * 3)
    one = _word_tokenizer(tmp_path / "one.json", ["alpha", "beta", "gamma"])
    two = _word_tokenizer(tmp_path / "two.json", ["gamma", "beta", "alpha"])  # same size, other ids
    by_byte = prepare(corpus, ByteTokenizer(), tmp_path / "byte", val_fraction=0.1)
    by_one = prepare(corpus, BPETokenizer.load(one), tmp_path / "one", val_fraction=0.1)
    return {"byte": by_byte, "one": by_one, "one.json": one, "two.json": two}


def _problems(make_config, tmp_path, **keys):
    try:
        validate(make_config(tmp_path, **keys))
    except ConfigError as err:
        return err.problems
    return []


def test_the_tokenizer_a_folder_was_prepared_with_is_accepted(folders, make_config, tmp_path):
    assert load_index(folders["one"])["tokenizer"] == BPETokenizer.load(folders["one.json"]).name
    assert _problems(make_config, tmp_path, **{"data.corpus": str(folders["byte"])}) == []
    assert _problems(make_config, tmp_path, **{"data.corpus": str(folders["one"]),
                                               "data.tokenizer": str(folders["one.json"])}) == []


@pytest.mark.parametrize("folder, spec", [("one", "byte"), ("one", "two.json"), ("byte", "one.json"),
                                          ("one", "bpe:300")])
def test_another_tokenizer_is_refused_in_one_line(folders, make_config, tmp_path, folder, spec):
    spec = str(folders[spec]) if spec.endswith(".json") else spec
    problems = _problems(make_config, tmp_path, **{"data.corpus": str(folders[folder]), "data.tokenizer": spec})
    assert len(problems) == 1 and "\n" not in problems[0]
    prepared_with = load_index(folders[folder])["tokenizer"]
    assert f"was prepared with the tokenizer {prepared_with}" in problems[0]
    assert f"not data.tokenizer '{spec}'" in problems[0]


def test_a_mixture_source_is_held_to_it_too(folders, make_config, tmp_path):
    mix = f"{folders['byte']}=1,{folders['one']}=1"
    problems = _problems(make_config, tmp_path, **{"data.mix": mix, "data.corpus": None})
    assert any(f"data.mix source '{folders['one']}' was prepared with" in p for p in problems)
    assert not any(str(folders["byte"]) in p for p in problems)


def test_a_bpe_prepared_folder_samples_with_the_bpe_that_prepared_it(tmp_path, make_config):
    """`data prepare --tokenizer bpe:300` trains its BPE on the source and keeps it in the cache;
    a run on the prepared folder with data.tokenizer = 'bpe:300' passes, and its samples and
    evaluations load that BPE (they used to train another one on the prepared folder's own files)."""
    from gridtrain.cli import main
    from gridtrain.train.inference import run_tokenizer

    corpus, cache, out = tmp_path / "corpus", tmp_path / "cache", tmp_path / "prepared"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"d{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + 1\n" * 4)
    assert main(["data", "prepare", str(corpus), "--tokenizer", "bpe:300", "--out", str(out),
                 "--cache-dir", str(cache), "--workers", "1"]) == 0
    keys = {"data.corpus": str(out), "data.tokenizer": "bpe:300", "data.cache_dir": str(cache)}
    assert _problems(make_config, tmp_path, **keys) == []
    assert run_tokenizer(make_config(tmp_path, **keys)).name == load_index(out)["tokenizer"]
    # Another BPE of 300 kept under the source's name: refused, naming the cached file.
    (other := tmp_path / "other").mkdir()
    (other / "a.txt").write_text("lorem ipsum dolor sit amet " * 50)
    trained = next(cache.glob("tokenizer-bpe300-*.json"))
    BPETokenizer.train([(other / "a.txt").read_text()], 300, save_path=trained)
    problems = _problems(make_config, tmp_path, **keys)
    assert len(problems) == 1 and f"not data.tokenizer 'bpe:300' (the data cache's {trained})" in problems[0]


def test_a_hand_made_index_without_its_source_samples_with_the_byte_tokenizer(folders, make_config, tmp_path):
    """Only a bpe:N looks for the source a prepared folder names (where its BPE was trained): a byte
    run on a folder whose index.json names no source (validation lets a hand-made index pass) loads
    its tokenizer for samples and evaluation, where it raised KeyError: 'source'."""
    import json

    from gridtrain.train.inference import run_tokenizer

    index_path = folders["byte"] / "index.json"
    index = json.loads(index_path.read_text())
    del index["source"]
    index_path.write_text(json.dumps(index))
    cfg = make_config(tmp_path, **{"data.corpus": str(folders["byte"])})
    assert _problems(make_config, tmp_path, **{"data.corpus": str(folders["byte"])}) == []
    assert list(run_tokenizer(cfg).encode("ab")) == [97, 98]
