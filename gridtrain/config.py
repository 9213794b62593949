"""Run configuration: nested dataclasses, TOML files, dotted command-line overrides, validation.

Every field carries a docstring (shown by `gridtrain train --help-config`). A configuration is
built by `load_config(toml_path, overrides)` and checked once by `validate(cfg)`, before any
process or process group exists; every broken relation is reported together, with the numbers and
the fix.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import math
import tomllib
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from gridtrain.model.args import PRESETS, ModelArgs, model_args


class ConfigError(ValueError):
    """An invalid configuration; `problems` lists each broken relation."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class ModelConfig:
    preset: str = "small"
    """Named model shape (see `gridtrain model --list`); the fields below override it."""
    dim: int | None = None
    """Width of the residual stream; None keeps the preset's."""
    n_layers: int | None = None
    """Number of transformer blocks; None keeps the preset's."""
    n_heads: int | None = None
    """Attention query heads; None keeps the preset's."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None keeps the preset's."""
    ffn_dim: int | None = None
    """SwiGLU hidden width; None keeps the preset's (or Llama's rounding rule)."""
    vocab_size: int | None = None
    """Embedding rows; None keeps the preset's. Must hold the tokenizer's vocabulary."""
    rope_theta: float | None = None
    """RoPE base frequency; None keeps the preset's."""
    rope_scaling: bool | None = None
    """Llama 3.1 RoPE frequency scaling; None keeps the preset's."""
    max_seq_len: int | None = None
    """The model's context (RoPE table length); None keeps the preset's."""
    tie_embeddings: bool | None = None
    """Share embedding and output head; None keeps the preset's."""

    def args(self) -> ModelArgs:
        overrides = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "preset"}
        return model_args(self.preset, **overrides)


@dataclass
class DataConfig:
    corpus: str | None = None
    """Text file, directory, JSON-lines file or prepared token directory; None: the Python stdlib."""
    tokenizer: str = "byte"
    """'byte' (no files), a path to a tokenizer.json, or 'bpe:N' to train a BPE of vocabulary N."""
    seq_len: int = 256
    """Tokens per training sequence."""
    val_fraction: float = 0.005
    """Fraction of the corpus's documents held out for validation."""
    cache_dir: str = "~/.cache/gridtrain"
    """Where prepared token shards and trained tokenizers are kept."""


@dataclass
class TrainConfig:
    steps: int = 250
    """Optimizer steps of the run."""
    global_batch: int = 16
    """Sequences per optimizer step (micro_batch x accumulation x data-parallel degree)."""
    global_batch_tokens: int | None = None
    """Global batch in tokens instead of sequences; must be a multiple of data.seq_len."""
    micro_batch: int = 8
    """Sequences in one forward/backward pass of one data-parallel rank."""
    lr: float = 2e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine, linear, wsd)."""
    warmup_steps: int = 25
    """Steps of linear warm-up from 0 to the peak learning rate."""
    schedule: str = "cosine"
    """Decay after warm-up: 'cosine', 'linear', 'wsd' (warmup-stable-decay) or 'constant'."""
    decay_fraction: float = 0.2
    """For 'wsd': the final fraction of the steps over which the rate decays."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (applied to matrices, not to norms or embeddings)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off (the norm is still reported)."""
    precision: str = "fp32"
    """'fp32', 'bf16' (autocast, fp32 master weights) or 'fp16' (autocast + dynamic loss scaling)."""
    loss_scale_init: float = 65536.0
    """fp16: initial loss scale."""
    loss_scale_growth_interval: int = 2000
    """fp16: clean steps after which the loss scale doubles (it halves on every overflow)."""
    activation_checkpointing: str = "off"
    """'off', 'selective' (recompute cheap ops, keep matmul and attention outputs) or 'full'."""
    seed: int = 0
    """Seed of initialisation and data order."""
    compile: bool = False
    """Compile each transformer block with torch.compile."""
    val_every: int = 50
    """Validation loss every N steps (and at the end); 0 turns it off."""
    val_batches: int = 8
    """Micro-batches of held-out data per validation."""
    threads: int | None = None
    """CPU threads for torch (None: torch's default)."""


@dataclass
class CheckpointConfig:
    dir: str | None = None
    """Checkpoint directory; None means <run_dir>/checkpoints."""
    interval: int = 0
    """Save every N steps (and at the end); 0 turns saving off."""
    keep: int = 3
    """Number of most recent checkpoints kept."""
    resume: bool = False
    """Continue from the newest checkpoint in the checkpoint directory."""


@dataclass
class MetricsConfig:
    log_every: int = 10
    """Log a line (and write metrics) every N steps."""
    tensorboard: bool = True
    """Also write TensorBoard event files into the run directory."""
    progress: bool = True
    """Show a progress bar when standard error is a terminal."""


@dataclass
class Config:
    run_dir: str = "runs/default"
    """The run directory: metrics.jsonl, TensorBoard events, checkpoints by default."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.run_dir) / "checkpoints"

    @property
    def global_batch_seqs(self) -> int:
        if self.train.global_batch_tokens is not None:
            return self.train.global_batch_tokens // self.data.seq_len
        return self.train.global_batch


# ---------------------------------------------------------------------------------------------
# Keys, docstrings, overrides


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
            if isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = nxt.value.value
    return docs


def all_keys(cfg: Any = None, prefix: str = "") -> dict[str, tuple[Any, str]]:
    """Every dotted key with its (type, docstring)."""
    cfg = cfg if cfg is not None else Config()
    hints, docs = typing.get_type_hints(type(cfg)), field_docs(type(cfg))
    keys: dict[str, tuple[Any, str]] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value):
            keys.update(all_keys(value, f"{prefix}{f.name}."))
        else:
            keys[prefix + f.name] = (hints[f.name], docs.get(f.name, ""))
    return keys


def _unknown_key(key: str) -> str:
    close = difflib.get_close_matches(key, list(all_keys()), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "; see `gridtrain train --help-config`"
    return f"unknown config key '{key}'{hint}"


def _convert(key: str, raw: Any, hint: Any) -> Any:
    """Turn a TOML value or command-line string into the field's type."""
    options = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
        if type(None) in typing.get_args(hint):
            return None
        raise ConfigError([f"{key} cannot be none"])
    target = options[0]
    if isinstance(raw, target) and not (target is int and isinstance(raw, bool)):
        return raw
    if target is bool and isinstance(raw, str):
        if raw.lower() in ("true", "1", "yes", "on"):
            return True
        if raw.lower() in ("false", "0", "no", "off"):
            return False
    elif target is int and isinstance(raw, (str, float)):
        number = _number(raw)
        if number is not None and float(number).is_integer():
            return int(number)  # accepts 1000, 1_000, 1e3 and 1000.0
    elif target is float and isinstance(raw, (str, int)) and not isinstance(raw, bool):
        try:
            return float(raw)
        except ValueError:
            pass
    elif target is str:
        return str(raw)
    raise ConfigError([f"{key} = {raw!r} is not a valid {target.__name__}"])


def _number(raw: str | float) -> float | None:
    try:
        return float(raw)
    except ValueError:
        return None


def set_key(cfg: Config, key: str, raw: Any) -> None:
    keys = all_keys(cfg)
    if key not in keys:
        raise ConfigError([_unknown_key(key)])
    *path, name = key.split(".")
    target = cfg
    for part in path:
        target = getattr(target, part)
    setattr(target, name, _convert(key, raw, keys[key][0]))


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for k, v in table.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[prefix + k] = v
    return flat


def parse_overrides(args: list[str]) -> dict[str, str]:
    """`--train.steps 100 --train.compile` or `--train.steps=100` -> {'train.steps': '100', ...}."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError([f"unexpected argument '{arg}': overrides look like --section.key VALUE"])
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                value = "true"  # a bare flag switches a boolean on
        out[key.replace("-", "_")] = value
        i += 1
    return out


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults, then the TOML file, then the dotted overrides; unknown keys are rejected."""
    cfg = Config()
    items: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as f:
            items.update(_flatten(tomllib.load(f)))
    items.update(overrides or {})
    problems = []
    for key, raw in items.items():
        try:
            set_key(cfg, key, raw)
        except ConfigError as e:
            problems.extend(e.problems)
    if problems:
        raise ConfigError(problems)
    return cfg


# ---------------------------------------------------------------------------------------------
# Validation: every relation checked before anything starts

SCHEDULES = ("cosine", "linear", "wsd", "constant")
PRECISIONS = ("fp32", "bf16", "fp16")
AC_MODES = ("off", "selective", "full")


def _choice(key: str, value: str, options: tuple[str, ...]) -> list[str]:
    if value in options:
        return []
    return [f"{key} = '{value}' is not one of {', '.join(options)}"]


def _at_least(key: str, value: float, low: float) -> list[str]:
    return [] if value >= low else [f"{key} = {value} must be >= {low}"]


def _in_range(key: str, value: float, low: float, high: float) -> list[str]:
    return [] if low <= value <= high else [f"{key} = {value} must lie in [{low}, {high}]"]


def _check_model(cfg: Config) -> list[str]:
    if cfg.model.preset not in PRESETS:
        return [f"model.preset = '{cfg.model.preset}' is unknown; choose one of {', '.join(PRESETS)}"]
    args = cfg.model.args()
    problems = args.validate()
    if cfg.data.seq_len > args.max_seq_len:
        problems.append(
            f"data.seq_len ({cfg.data.seq_len}) is longer than the model's context "
            f"model.max_seq_len ({args.max_seq_len}): lower data.seq_len or raise model.max_seq_len")
    return problems


def _check_batch(cfg: Config, dp: int) -> list[str]:
    t, seq_len = cfg.train, cfg.data.seq_len
    problems = _at_least("train.micro_batch", t.micro_batch, 1) + _at_least("data.seq_len", seq_len, 1)
    if t.global_batch_tokens is not None:
        if t.global_batch_tokens <= 0 or seq_len <= 0 or t.global_batch_tokens % seq_len:
            return problems + [
                f"train.global_batch_tokens ({t.global_batch_tokens}) must be a positive multiple of "
                f"data.seq_len ({seq_len}): try {max(1, round(t.global_batch_tokens / max(seq_len, 1))) * seq_len}"]
    elif t.global_batch < 1:
        return problems + [f"train.global_batch = {t.global_batch} must be >= 1"]
    if problems:
        return problems
    per_step = t.micro_batch * dp
    if cfg.global_batch_seqs % per_step:
        fixed = max(1, round(cfg.global_batch_seqs / per_step)) * per_step
        return [f"train.global_batch ({cfg.global_batch_seqs} sequences) must be divisible by "
                f"train.micro_batch ({t.micro_batch}) x data-parallel degree ({dp}) = {per_step}: "
                f"set train.global_batch to {fixed} or choose a micro_batch that divides it"]
    return []


def _check_train(cfg: Config) -> list[str]:
    t = cfg.train
    problems = _at_least("train.steps", t.steps, 1)
    problems += [] if t.lr > 0 else [f"train.lr = {t.lr} must be > 0"]
    problems += _in_range("train.min_lr_ratio", t.min_lr_ratio, 0.0, 1.0)
    if not 0 <= t.warmup_steps <= max(t.steps, 0):
        problems.append(f"train.warmup_steps ({t.warmup_steps}) must lie in [0, train.steps "
                        f"({t.steps})]: lower train.warmup_steps or raise train.steps")
    problems += _choice("train.schedule", t.schedule, SCHEDULES)
    if not 0 < t.decay_fraction <= 1:
        problems.append(f"train.decay_fraction = {t.decay_fraction} must lie in (0, 1]")
    problems += _at_least("train.weight_decay", t.weight_decay, 0.0)
    for key, beta in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0 <= beta < 1:
            problems.append(f"{key} = {beta} must lie in [0, 1)")
    problems += [] if t.eps > 0 else [f"train.eps = {t.eps} must be > 0"]
    problems += _at_least("train.grad_clip", t.grad_clip, 0.0)
    problems += _choice("train.precision", t.precision, PRECISIONS)
    problems += [] if t.loss_scale_init > 0 else [f"train.loss_scale_init = {t.loss_scale_init} must be > 0"]
    problems += _at_least("train.loss_scale_growth_interval", t.loss_scale_growth_interval, 1)
    problems += _choice("train.activation_checkpointing", t.activation_checkpointing, AC_MODES)
    problems += _at_least("train.val_every", t.val_every, 0) + _at_least("train.val_batches", t.val_batches, 1)
    if t.threads is not None:
        problems += _at_least("train.threads", t.threads, 1)
    return problems


def _check_data(cfg: Config) -> list[str]:
    d = cfg.data
    problems = []
    if not 0 < d.val_fraction < 0.5:
        problems.append(f"data.val_fraction = {d.val_fraction} must lie in (0, 0.5)")
    if d.corpus is not None and not Path(d.corpus).expanduser().exists():
        problems.append(f"data.corpus = '{d.corpus}' does not exist: give a file or directory, "
                        "or leave it unset for the Python standard library")
    vocab = tokenizer_vocab_size(d.tokenizer)
    if vocab is None:
        problems.append(f"data.tokenizer = '{d.tokenizer}' is not 'byte', 'bpe:N' or an existing "
                        "tokenizer.json")
    elif cfg.model.preset in PRESETS and vocab > cfg.model.args().vocab_size:
        problems.append(
            f"model.vocab_size ({cfg.model.args().vocab_size}) is smaller than the vocabulary of "
            f"data.tokenizer '{d.tokenizer}' ({vocab}): set model.vocab_size to at least "
            f"{64 * math.ceil(vocab / 64)}")
    return problems


def tokenizer_vocab_size(spec: str) -> int | None:
    """The vocabulary a tokenizer spec will have, without building it (None if the spec is bad)."""
    if spec == "byte":
        return 257  # 256 byte values + <eos>
    if spec.startswith("bpe:"):
        n = spec[4:]
        return int(n) if n.isdigit() and int(n) >= 258 else None
    path = Path(spec).expanduser()
    if path.is_file():
        from tokenizers import Tokenizer  # only for this path: the file must parse

        try:
            return Tokenizer.from_file(str(path)).get_vocab_size()
        except Exception:  # noqa: BLE001 - any parse failure means the file is not a tokenizer
            return None
    return None


def validate(cfg: Config, dp: int = 1) -> None:
    """Raise ConfigError listing every broken relation; `dp` is the data-parallel degree."""
    problems = _check_model(cfg) + _check_batch(cfg, dp) + _check_train(cfg) + _check_data(cfg)
    problems += _at_least("checkpoint.interval", cfg.checkpoint.interval, 0)
    problems += _at_least("checkpoint.keep", cfg.checkpoint.keep, 1)
    problems += _at_least("metrics.log_every", cfg.metrics.log_every, 1)
    if problems:
        raise ConfigError(problems)
