"""Building a Config: TOML files and dotted command-line overrides, every key converted to its
field's type (a count exactly, a float finite, a choice as given) and every unknown key refused
with the nearest known one. `load_config` is the one way in; `gridtrain.validate` then checks the
relations between the values.
"""

from __future__ import annotations

import ast
import difflib
import functools
import inspect
import math
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from gridtrain import tomlread
from gridtrain.config import Config, ConfigError


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (parsed once per class)."""
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
    return dict(_key_table(type(cfg) if cfg is not None else Config, prefix))


@functools.cache
def _key_table(cls: type, prefix: str) -> dict[str, tuple[Any, str]]:
    """`all_keys` of a class, built once (`set_key` reads it for every key it sets); not to be changed."""
    return dict(_keys_of(cls, prefix))


@functools.cache
def _keys_of(cls: type, prefix: str) -> tuple[tuple[str, tuple[Any, str]], ...]:
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    keys: list[tuple[str, tuple[Any, str]]] = []
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            keys.extend(_keys_of(hints[f.name], f"{prefix}{f.name}."))
        else:
            keys.append((prefix + f.name, (hints[f.name], docs.get(f.name, ""))))
    return tuple(keys)


RENAMED = {"train.activation_checkpointing": "train.recompute ('off' is now 'none')"}
"""Keys an earlier gridtrain had, and what they are called now."""


def _unknown_key(key: str) -> str:
    if key in RENAMED:
        return f"config key '{key}' is now {RENAMED[key]}"
    close = difflib.get_close_matches(key, list(all_keys()), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "; see `gridtrain train --help-config`"
    return f"unknown config key '{key}'{hint}"


LARGEST_INT = 10**15
"""No count in a configuration comes near this (tokens per batch, steps, dimensions); past it a
typo like 1e20 would overflow torch's int64 sizes mid-run instead of being refused."""

BARE_FLAG = "\0flag"
"""What `parse_overrides` gives `--key` without a value: true for a boolean key, an error for others."""


@functools.cache
def _hint_parts(hint: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], Any]:
    """A field's type taken apart once: (its Literal choices, its arguments, its origin)."""
    return (tuple(a for a in typing.get_args(hint) if typing.get_origin(a) is typing.Literal),
            typing.get_args(hint), typing.get_origin(hint))


def _convert(key: str, raw: Any, hint: Any) -> Any:
    """Turn a TOML value or command-line string into the field's type."""
    choices, args, origin = _hint_parts(hint)
    values = _hint_parts(choices[0])[1] if choices else ()
    if choices and isinstance(raw, str) and raw.lower() in values:
        raw = raw.lower()  # 'None' is the choice 'none' as much as 'none' is
    if choices and raw is not None and (raw in values or not (isinstance(raw, str) and raw.lower() in ("none", "null"))):
        # An optional choice (model.moe.balance): a value is one of the choices, 'none' too where it
        # is one (balance 'none'); unset, the preset's.
        hint = choices[0]
        _, args, origin = _hint_parts(hint)
    if origin is typing.Literal:  # a choice ('none' may be one): validate names the values
        if raw == BARE_FLAG or not isinstance(raw, str):
            raise ConfigError([f"{key} = {raw!r} is not one of {', '.join(args)}"
                               if raw != BARE_FLAG else f"--{key} needs a value (--{key} VALUE)"])
        return raw
    options = [a for a in args if a is not type(None)] or [hint]
    if raw == BARE_FLAG:
        if bool not in options:
            raise ConfigError([f"--{key} needs a value (--{key} VALUE)"])
        raw = "true"
    if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
        if type(None) in args:
            return None
        raise ConfigError([f"{key} cannot be none"])
    for target in options:
        try:
            return _convert_to(key, raw, target)
        except ConfigError:
            if target is options[-1]:
                raise
    raise AssertionError("unreachable")


def _convert_to(key: str, raw: Any, target: type) -> Any:
    if target is float and isinstance(raw, float) and not math.isfinite(raw):  # TOML's inf and nan
        raise ConfigError([f"{key} = {raw!r} must be a finite number"])
    if target is int and not isinstance(raw, bool) and isinstance(raw, (int, str, float)):
        number = _whole(raw)
        if number is not None:
            largest = 2**63 - 1 if key.endswith("seed") else LARGEST_INT  # a seed is a label, not a count
            if abs(number) > largest:
                raise ConfigError([f"{key} = {raw!r} is too large (at most {largest:.0e})"])
            return number
    elif isinstance(raw, target):
        return raw
    if target is bool and isinstance(raw, str):
        if raw.lower() in ("true", "1", "yes", "on"):
            return True
        if raw.lower() in ("false", "0", "no", "off"):
            return False
    elif target is float and isinstance(raw, (str, int)) and not isinstance(raw, bool):
        try:
            value = float(raw)
        except ValueError:
            pass
        else:
            if math.isfinite(value):
                return value
            raise ConfigError([f"{key} = {raw!r} must be a finite number"])
    elif target is str:
        return str(raw)
    raise ConfigError([f"{key} = {raw!r} is not a valid {target.__name__}"])


def _whole(raw: str | int | float) -> int | None:
    """An exact int from 1000, '1_000', '1e3' or 1000.0 (digits are read as digits, never through a
    float: 1732345678901234567 stays itself); None if it is not a whole number."""
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        try:
            return int(raw)
        except ValueError:
            pass
    try:
        number = float(raw)
    except ValueError:
        return None
    return int(number) if number.is_integer() else None


def set_key(cfg: Config, key: str, raw: Any) -> None:
    keys = _key_table(type(cfg), "")
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
                value = BARE_FLAG  # switches a boolean on; any other key wants a value
        out[key.replace("-", "_")] = value
        i += 1
    return out


BATCH_FORMS = ("train.global_batch", "train.global_batch_tokens")
"""The two ways to give the batch (sequences, tokens): one source gives one of them."""


def config_from_dict(table: dict[str, Any]) -> Config:
    """A Config from its nested dict (dataclasses.asdict's form, as a run record keeps it: both
    forms of the batch, the one not given None)."""
    items = _flatten(table)
    if items.get("train.global_batch_tokens") is not None:
        items.pop("train.global_batch", None)
    return load_config(None, items)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults, then the TOML file, then the dotted overrides; unknown keys are rejected."""
    cfg = Config()
    items: dict[str, Any] = {}
    problems = []
    if path is not None:
        try:
            with open(path, "rb") as f:
                items.update(_flatten(tomlread.load(f)))
        except OSError as err:
            raise ConfigError([f"--config {path}: {err.strerror.lower()}: give a TOML file (see configs/)"]) from None
        except tomlread.TOMLDecodeError as err:
            raise ConfigError([f"--config {path} is not valid TOML ({err}): fix it (see configs/)"]) from None
    overrides = overrides or {}
    def given(source: dict[str, Any], key: str) -> bool:
        return source.get(key) is not None and str(source[key]).lower() not in ("none", "null")

    for source, values in (("--config", items), ("the command line", overrides)):
        if all(given(values, key) for key in BATCH_FORMS):
            problems.append(f"train.global_batch and train.global_batch_tokens are both given on {source}: give "
                            "one (the batch in sequences, or in tokens)")
    if any(given(overrides, key) for key in BATCH_FORMS):  # the command line's form replaces the file's
        items = {k: v for k, v in items.items() if k not in BATCH_FORMS}
    items.update(overrides)
    for key, raw in items.items():
        try:
            set_key(cfg, key, raw)
        except ConfigError as e:
            problems.extend(e.problems)
    if problems:
        raise ConfigError(problems)
    return cfg
