"""What a run learned, in one process: `gridtrain sample` and `gridtrain eval`.

`load_run` reads the run's record (model shape, tokenizer, data), picks its newest intact
checkpoint (or a given step's) and loads the full weights into one CPU process, whatever layout
wrote them: DCP reshards FSDP, TP and PP shards on reading. Sampling streams text as it is
produced; evaluation reports the loss, perplexity and bits per byte on the run's validation split
or on any text.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, TextIO

import numpy as np
import torch

from gridtrain.config import Config
from gridtrain.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer
from gridtrain.errors import BadInput
from gridtrain.model.generate import Sampling, generate
from gridtrain.model.llama import Transformer
from gridtrain.rundir import RunRecord
from gridtrain.train.hf_run import load_model_weights, model_shapes, open_checkpoint, read_run


@dataclass
class LoadedRun:
    cfg: Config
    model: Transformer
    tokenizer: Tokenizer
    checkpoint: Path


def run_tokenizer(cfg: Config) -> Tokenizer:
    """The tokenizer the run trained with (a trained BPE comes from the data cache)."""
    from gridtrain.data.corpus import default_corpus
    from gridtrain.data.shards import INDEX_FILE, load_index

    corpus = Path(cfg.data.corpus).resolve() if cfg.data.corpus else default_corpus()
    if cfg.data.tokenizer.startswith("bpe:") and (corpus / INDEX_FILE).is_file():
        source = load_index(corpus).get("source")  # a prepared folder: its bpe:N was trained on this source
        corpus = Path(source) if isinstance(source, str) else corpus  # a hand-made index may name none
    return build_tokenizer(cfg.data.tokenizer, corpus=corpus, cache_dir=Path(cfg.data.cache_dir).expanduser())


def load_run(run_dir: Path, step: int | None = None) -> LoadedRun:
    """The run's model with the weights of its newest intact checkpoint (or of `step`)."""
    cfg, root = read_run(Path(run_dir))
    args = cfg.model.args()
    path, reader = open_checkpoint(root, args, step)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.after_to_empty()
    model.restart_positions = cfg.data.doc_positions == "restart"
    missing, unexpected = model.load_state_dict(load_model_weights(reader, args, model_shapes(args)), strict=False)
    assert not unexpected and set(missing) <= {"output.weight"}, (missing, unexpected)
    return LoadedRun(cfg, model.eval(), run_tokenizer(cfg), path)


def encode_prompt(tokenizer: Tokenizer, text: str, context: int, max_new_tokens: int) -> tuple[list[int], str]:
    """The prompt's ids, cut from the left to leave room for the new tokens, and a note saying so."""
    try:
        ids = [int(i) for i in tokenizer.encode(text)]
    except Exception as err:  # noqa: BLE001 - a tokenizer's own error type
        raise BadInput(f"the run's tokenizer ({tokenizer.name}) cannot encode the prompt: {err}") from None
    if not ids:
        ids = [tokenizer.eos_id]  # an empty prompt starts a new document
    if max_new_tokens >= context:
        raise BadInput(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's "
                       f"context of {context} tokens: ask for fewer than {context}")
    room = context - max_new_tokens
    if len(ids) > room:
        kept = ids[-room:]
        if isinstance(tokenizer, ByteTokenizer):  # start at a character, not inside one
            while kept and 0x80 <= kept[0] < 0xC0:
                kept = kept[1:]
        return kept or [tokenizer.eos_id], (
            f"the prompt's {len(ids)} tokens and {max_new_tokens} new ones exceed the {context} the model was "
            f"trained on: kept the prompt's last {len(kept)} tokens")
    return ids, ""


def context_of(run: LoadedRun) -> int:
    """Positions the run trained on (its sequence length; the model's RoPE table may reach further)."""
    return min(run.model.args.max_seq_len, run.cfg.data.seq_len)


class TextStream:
    """Decode tokens as they come and write their text once it is whole: the byte tokenizer and
    byte-level BPE decode to concatenated bytes, so only the tokens since the last whole
    character are decoded again (a UTF-8 character may need the next token)."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO) -> None:
        self.tokenizer, self.out, self.ids, self.pending = tokenizer, out, [], []

    def add(self, token: int) -> None:
        self.ids.append(token)
        self.pending.append(token)
        text = self.tokenizer.decode(self.pending)
        if not text.endswith("\ufffd"):  # an unfinished character waits for its next bytes
            self._write(text)

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
        self.pending = []

    def close(self) -> str:
        if self.pending:
            self._write(self.tokenizer.decode(self.pending))
        return self.tokenizer.decode(self.ids)


def sample(run: LoadedRun, prompt: str, max_new_tokens: int, sampling: Sampling, seed: int = 0,
           num_samples: int = 1, out: TextIO | None = None, use_cache: bool = True) -> list[list[int]]:
    """Stream `num_samples` continuations of `prompt` to `out`; returns their new token ids."""
    out = out or sys.stdout
    ids, note = encode_prompt(run.tokenizer, prompt, context_of(run), max_new_tokens)
    if note:
        print(f"note: {note}", file=sys.stderr)
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for n in range(num_samples):
        if num_samples > 1:
            out.write(f"{'' if n == 0 else chr(10)}--- sample {n + 1} of {num_samples}\n")
        out.write(run.tokenizer.decode(ids) if note else prompt)  # what the model sees
        stream = TextStream(run.tokenizer, out)
        for token in generate(run.model, torch.tensor([ids]), max_new_tokens, sampling, generator, use_cache,
                              stop_id=run.tokenizer.eos_id, vocab=run.tokenizer.vocab_size):
            if int(token[0]) == run.tokenizer.eos_id:  # the end of a document: the sample ends
                break
            stream.add(int(token[0]))
        stream.close()
        out.write("\n")
        samples.append(stream.ids)
    return samples


def print_sample(run_dir: Path, tokens: int, prompt: str, out: TextIO | None = None) -> None:
    """The end of `gridtrain train`: a sample from the checkpoint it just saved, as `gridtrain sample`
    gives it with its defaults (the model's own distribution, seed 0). A lower temperature or top-k
    make a small model repeat itself (runs of spaces, for one trained on Python)."""
    out = out or sys.stdout
    run = load_run(run_dir)
    step = int(run.checkpoint.name.removeprefix("step-"))
    out.write(f"sample of the model at step {step} (more: gridtrain sample {run_dir}):\n")
    sample(run, prompt, min(tokens, context_of(run) - 1), Sampling(), out=out)


def token_bytes(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for `<eos>`): the denominator of bits per byte."""
    if isinstance(tokenizer, ByteTokenizer):
        out = np.ones(tokenizer.vocab_size, dtype=np.int64)
        out[tokenizer.eos_id] = 0
        return out
    hf = tokenizer._tok  # a byte-level BPE: each character of a token's string is one byte
    out = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for token, index in hf.get_vocab(with_added_tokens=False).items():
        if index < len(out):
            out[index] = len(token)
    out[tokenizer.eos_id] = 0
    return out


@torch.no_grad()
def evaluate(run: LoadedRun, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Mean loss over every target token of `batches` (as the training run's validation computes
    it: the run's precision, the sum of each batch's mean x its tokens), perplexity, bits per byte."""
    from gridtrain.model.documents import document_ids
    from gridtrain.train.build import loss_fn
    from gridtrain.train.precision import Precision

    precision = Precision(run.cfg.train, torch.device("cpu"))
    nbytes = torch.from_numpy(token_bytes(run.tokenizer))
    total, count, total_bytes, sequences = torch.zeros(()), torch.zeros(()), 0, 0
    for inputs, targets in batches:
        # a run trained with data.doc_mask is evaluated as it validated: inside each document
        docs = [document_ids(inputs, run.tokenizer.eos_id)] if run.cfg.data.doc_mask else []
        with precision.autocast():
            loss = loss_fn(run.model(inputs, *docs), targets)
        total += loss.float() * targets.numel()
        count += targets.numel()
        total_bytes += int(nbytes[targets].sum())
        sequences += len(targets)
    if count == 0:
        raise BadInput("nothing to evaluate: the data holds no sequence of the run's length")
    loss = (total / count).item()
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(count.item()),
            "sequences": sequences, "bytes": total_bytes,
            "bits_per_byte": (total.item() / math.log(2) / total_bytes) if total_bytes else float("nan")}


def validation_batches(run: LoadedRun, run_dir: Path, batches: int | None = None
                       ) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """The run's validation split, the sequences its training validated on (`Evaluator`: the first
    train.val_batches micro-batches, whole pipeline batches under PP), or the first `batches`
    micro-batches."""
    from gridtrain.train import evaluate
    from gridtrain.train.build import prepared_data, val_reader

    cfg = run.cfg
    reader = val_reader(cfg, prepared_data(cfg))
    mb = cfg.train.micro_batch
    if batches is not None:
        return reader.batches(mb, batches)
    dims = RunRecord.load(Path(run_dir)).dims
    pipelined = dims is not None and dims.pp > 1
    size, count = evaluate.validation_batches(cfg, cfg.microbatches(dims.dp) if pipelined else None)
    whole = min(count * size, reader.num_samples // size * size)  # Evaluator stops at a short batch
    return reader.batches(mb, max(1, whole // mb))


def text_batches(run: LoadedRun, source: Path, batches: int) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """Any text file, directory or JSON lines, tokenised with the run's tokenizer (documents
    ended by <eos>, as the run's data), cut into sequences of the run's length, in batches of its
    micro-batch."""
    from gridtrain.data.corpus import iter_documents
    from gridtrain.data.shards import encode_with_eos

    seq, mb = run.cfg.data.seq_len, run.cfg.train.micro_batch
    need = batches * mb * seq + 1
    stream: list[np.ndarray] = []
    held = 0
    for text in iter_documents(source):
        stream += encode_with_eos([text], run.tokenizer, np.dtype(np.int64))
        held += len(stream[-1])
        if held >= need:
            break
    tokens = np.concatenate(stream) if stream else np.zeros(0, dtype=np.int64)
    count = min(batches * mb, (len(tokens) - 1) // seq)
    for first in range(0, count, mb):
        rows = np.stack([tokens[i * seq:(i + 1) * seq + 1] for i in range(first, min(first + mb, count))])
        yield torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())
