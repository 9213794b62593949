"""Tokenizers: a byte-level default that needs no files, and byte-level BPE via Hugging Face."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from gridtrain.errors import BadInput
from gridtrain.inputs import read_input

logger = logging.getLogger(__name__)

EOS_TOKEN = "<eos>"
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "<|endoftext|>", "</s>", "<|im_end|>")
"""The token that ends a document, when the tokenizer_config.json beside a tokenizer.json names none:
the first of these the vocabulary holds (gridtrain's own, Llama 3's, GPT-2's, Llama 2's, Qwen's)."""
TOKENIZER_FILE_BYTES = 256 * 2**20
"""The largest tokenizer.json read (256 MiB; Llama 3's is 9 MB, the largest vocabularies' some tens)."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer. `eos_id` separates documents."""

    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int] | np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text, 256 is `<eos>`."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids)
        pieces = np.split(ids, np.flatnonzero(ids == self.eos_id))
        texts = [bytes(p[p != self.eos_id].astype(np.uint8)).decode("utf-8", errors="replace")
                 for p in pieces]
        return EOS_TOKEN.join(texts)


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) backed by `tokenizers.Tokenizer`."""

    def __init__(self, hf_tokenizer: HFTokenizer, eos_token: str | None = None) -> None:
        names = (eos_token,) if eos_token else EOS_CANDIDATES
        eos_id = next((i for i in map(hf_tokenizer.token_to_id, names) if i is not None), None)
        if eos_id is None:
            raise BadInput(f"tokenizer has no end-of-document token ({' or '.join(map(repr, names))}); gridtrain "
                           "needs one to separate documents (add it as a special token, or name it as eos_token "
                           "in a tokenizer_config.json beside the tokenizer.json)")
        self._tok = hf_tokenizer
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id: int = eos_id
        digest = hashlib.sha256(hf_tokenizer.to_str().encode()).hexdigest()[:8]
        self.name: str = f"bpe-{self.vocab_size}-{digest}"

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        """A tokenizer.json; its end-of-document token is the eos_token of the tokenizer_config.json
        that transformers' save_pretrained writes beside it, when there is one."""
        path = Path(path).expanduser()
        return cls(read_tokenizer_json(path, f"tokenizer file {path}"), configured_eos(path))

    @classmethod
    def train(cls, documents: Iterable[str], vocab_size: int,
              save_path: str | Path | None = None) -> BPETokenizer:
        """Train a byte-level BPE with `<eos>` as its one special token (id 0)."""
        min_vocab = 256 + 1
        if vocab_size < min_vocab:
            raise BadInput(f"BPE vocab_size {vocab_size} < {min_vocab} "
                             f"(256 byte symbols + <eos>); ask for bpe:{min_vocab} or more")
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(documents, trainer=trainer)
        tok = cls(hf)
        if save_path is not None:
            tok.save(save_path)
        return tok

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            self._tok.save(tmp)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def configured_eos(tokenizer_json: Path) -> str | None:
    """The eos_token named by the tokenizer_config.json beside a tokenizer.json, if any."""
    config = tokenizer_json.parent / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        eos = json.loads(read_input(config, str(config), 2**24).decode("utf-8")).get("eos_token")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) else None


def read_tokenizer_json(path: Path, label: str) -> HFTokenizer:
    """The tokenizers.Tokenizer of a tokenizer.json, checked first (a regular file of at most
    TOKENIZER_FILE_BYTES); BadInput or MissingInput saying "<label> <why>"."""
    data = read_input(path, label, TOKENIZER_FILE_BYTES)
    try:
        return HFTokenizer.from_str(data.decode("utf-8"))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception
        why = str(err).splitlines()[0] if str(err).strip() else type(err).__name__
        raise BadInput(f"{label} is not a tokenizer.json that tokenizers can read ({why})") from None


def encode_batch(tokenizer: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Encode several texts, batched when the tokenizer supports it (any Tokenizer works)."""
    batched = getattr(tokenizer, "encode_batch", None)
    if batched is not None:
        return batched(texts)
    return [np.asarray(tokenizer.encode(t)) for t in texts]


def build_tokenizer(spec: str, corpus: str | Path | None = None,
                    cache_dir: Path | None = None) -> Tokenizer:
    """Build a tokenizer from a spec.

    `"byte"`: ByteTokenizer. A path to a `tokenizer.json`: BPETokenizer.load. `"bpe:N"`: train a
    byte-level BPE of vocab N on `corpus` (default: the Python stdlib), cached in `cache_dir`
    keyed by corpus and N so that it is trained once.
    """
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        return _build_trained_bpe(spec, corpus, cache_dir)
    if spec.endswith(".json") or os.path.lexists(Path(spec).expanduser()):
        return BPETokenizer.load(spec)  # says why a path that is not a tokenizer.json is refused
    raise BadInput(f"unknown tokenizer spec {spec!r}: expected 'byte', 'bpe:N' (train a BPE "
                     "of vocab N on the corpus) or a path to a tokenizer.json")


def trained_bpe_path(source: Path, vocab_size: int, cache_dir: Path) -> Path:
    """Where `bpe:N` trained on `source` (resolved) is kept in `cache_dir`."""
    key = hashlib.sha256(f"{source}\0{vocab_size}".encode()).hexdigest()[:12]
    return cache_dir / f"tokenizer-bpe{vocab_size}-{key}.json"


def _build_trained_bpe(spec: str, corpus: str | Path | None,
                       cache_dir: Path | None) -> BPETokenizer:
    from gridtrain.data.corpus import default_corpus, iter_documents

    try:
        vocab_size = int(spec.removeprefix("bpe:"))
    except ValueError:
        raise BadInput(f"bad tokenizer spec {spec!r}: expected 'bpe:N' with N an integer, "
                         "e.g. 'bpe:8192'") from None
    source = Path(corpus).resolve() if corpus is not None else default_corpus()
    if cache_dir is None:
        logger.info("training BPE (vocab %d) on %s without a cache_dir: it will not be reused",
                    vocab_size, source)
        return BPETokenizer.train(iter_documents(source), vocab_size)
    path = trained_bpe_path(source, vocab_size, Path(cache_dir))
    if path.is_file():
        return BPETokenizer.load(path)
    logger.info("training BPE (vocab %d) on %s -> %s", vocab_size, source, path)
    return BPETokenizer.train(iter_documents(source), vocab_size, save_path=path)
