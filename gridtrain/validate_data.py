"""Validation of the data keys: the corpus or the mixture's sources (missing, unreadable, a
vocabulary larger than the model's), the tokenizer spec, and document masking."""

from __future__ import annotations

import math
from pathlib import Path

from gridtrain.config import Config
from gridtrain.errors import MissingInput, UserError
from gridtrain.inputs import read_json
from gridtrain.validate_rules import choice as _choice, shape_of


def check_data(cfg: Config) -> list[str]:
    d = cfg.data
    problems = []
    if not 0 < d.val_fraction < 0.5:
        problems.append(f"data.val_fraction = {d.val_fraction} must lie in (0, 0.5)")
    problems += _check_documents(cfg)
    sources = [("data.corpus", d.corpus)]
    if d.mix is not None:
        from gridtrain.data.mix_spec import parse_mix

        if d.corpus is not None:
            problems.append(f"data.mix and data.corpus ('{d.corpus}') are both set: a mixture names its sources; "
                            "unset data.corpus or data.mix")
        try:
            sources = [(f"data.mix source '{s.path}'", s.path) for s in parse_mix(d.mix)]
        except UserError as err:
            return problems + [str(err)]
    for key, corpus in sources:
        problems += _check_source(cfg, key, corpus)
    return list(dict.fromkeys(problems))  # a tokenizer's problem once, not once per source


def _check_documents(cfg: Config) -> list[str]:
    """data.doc_mask and data.doc_positions: what runs with them (one process, DP, FSDP, TP, PP, CP)."""
    d = cfg.data
    problems = _choice("data.doc_positions", d.doc_positions, ("continue", "restart"))
    if d.doc_positions == "restart" and not d.doc_mask:
        problems.append("data.doc_positions = 'restart' restarts RoPE positions at each document, which needs "
                        "data.doc_mask: set data.doc_mask to true, or data.doc_positions to 'continue'")
    if d.doc_mask and cfg.train.compile:
        problems.append("data.doc_mask gives every micro-batch its own attention blocks, which train.compile's "
                        "whole-block graphs cannot hold: set train.compile to false, or data.doc_mask to false")
    return problems


def _check_source(cfg: Config, key: str, corpus: str | None) -> list[str]:
    """A corpus (None: the standard library) that is missing, unreadable, or of a vocabulary larger than the model's."""
    d = cfg.data
    label = f"{key} = '{corpus}'" if key == "data.corpus" else key
    if corpus is not None and not Path(corpus).expanduser().exists():
        return [f"{label} does not exist: give a file or directory"
                + (", or leave it unset for the Python standard library" if key == "data.corpus" else "")]
    index = Path(corpus).expanduser() / "index.json" if corpus is not None else None
    if index is not None and index.is_file():  # a prepared corpus: its own tokens decide, not data.tokenizer
        try:
            manifest = read_json(index, str(index))
            vocab, source = int(manifest["vocab_size"]), f"the prepared corpus {corpus}"
            prepared_with = manifest.get("tokenizer")  # every prepare writes it; a hand-made index may not
        except (UserError, ValueError, KeyError, TypeError, OverflowError) as err:
            return [f"{label} has an unreadable index.json ({err}): prepare it again with `gridtrain data prepare`"]
        bad = None if prepared_with is None else tokenizer_mismatch(label, d.tokenizer, str(prepared_with), vocab,
                                                                    trained_bpe(d.tokenizer, manifest, d.cache_dir))
        if bad:
            return [bad]
    else:
        if index is not None:
            from gridtrain.data.corpus import source_problem  # a corpus to prepare: its files' schemas, read now

            found = source_problem(index.parent, d.text_column)
            if found:
                return [f"{key}: {found}"]
        (vocab, bad), source = tokenizer_vocab(d.tokenizer), f"data.tokenizer '{d.tokenizer}'"
    if vocab is None:
        return [bad]
    if shape_of(cfg) is not None and vocab > cfg.model.args().vocab_size:
        return [f"model.vocab_size ({cfg.model.args().vocab_size}) is smaller than the vocabulary of "
                f"{source} ({vocab}): set model.vocab_size to at least {64 * math.ceil(vocab / 64)}"]
    return []


def trained_bpe(spec: str, manifest: dict, cache_dir: str) -> Path | None:
    """For a 'bpe:N' spec, the BPE of N trained on the prepared corpus's source, where the data cache
    keeps it (what samples and evaluation will load), if it is there."""
    if not spec.startswith("bpe:") or not spec[4:].isdigit() or not isinstance(manifest.get("source"), str):
        return None
    from gridtrain.data.tokenizer import trained_bpe_path

    path = trained_bpe_path(Path(manifest["source"]), int(spec[4:]), Path(cache_dir).expanduser())
    return path if path.is_file() else None


def tokenizer_mismatch(label: str, spec: str, prepared_with: str, vocab: int, trained: Path | None = None) -> str | None:
    """Why data.tokenizer is not the tokenizer a prepared corpus was tokenized with (its index.json's
    name: 'byte', or 'bpe-VOCAB-DIGEST' of the tokenizer.json's content), or None. Samples and
    evaluation decode with data.tokenizer, so another one would read the run's tokens as other text.
    A 'bpe:N' spec is held to the BPE the data cache keeps for the corpus's source (`trained`), or
    where it keeps none (it would be trained again on that source), to the vocabulary."""
    if spec == "byte":
        same = prepared_with == "byte"
    elif spec.startswith("bpe:") and trained is None:
        same = prepared_with.startswith(f"bpe-{spec[4:]}-")
    else:
        from gridtrain.data.tokenizer import BPETokenizer

        try:
            same = BPETokenizer.load(trained or spec).name == prepared_with
        except UserError as err:
            return str(err)
    if same:
        return None
    kept = f" (the data cache's {trained})" if trained else ""
    return (f"{label} was prepared with the tokenizer {prepared_with} (vocabulary {vocab:,}), not data.tokenizer "
            f"'{spec}'{kept}, which would decode its tokens as other text in samples and evaluation: set data.tokenizer "
            "to what `gridtrain data prepare --tokenizer` was given, or prepare the corpus again with this one")


def tokenizer_vocab(spec: str, key: str = "data.tokenizer") -> tuple[int | None, str | None]:
    """The vocabulary a tokenizer spec will have, without building it, or why the spec is bad."""
    if spec == "byte":
        return 257, None  # 256 byte values + <eos>
    if spec.startswith("bpe:"):
        n = spec[4:]
        if not n.isdigit():
            return None, f"{key} = '{spec}': N in bpe:N must be a whole number, e.g. bpe:8192"
        if int(n) < 257:
            return None, f"{key} = '{spec}': a BPE needs N >= 257 (256 byte symbols + <eos>), e.g. bpe:8192"
        return int(n), None
    from gridtrain.data.tokenizer import read_tokenizer_json  # only for this path: the file must parse

    try:
        return read_tokenizer_json(Path(spec).expanduser(), f"{key} = '{spec}'").get_vocab_size(), None
    except MissingInput:
        return None, f"{key} = '{spec}' is not 'byte', 'bpe:N' or an existing tokenizer.json file"
    except UserError as err:  # a directory, a device, too large, not a tokenizer.json
        return None, str(err)
