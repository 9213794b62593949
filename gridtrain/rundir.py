"""A run directory belongs to one run: checked before any process starts.

- Training into a directory that already holds a run (its config.json) without `--resume` would
  start a second run on top of the first (metrics appended, config.json replaced, the old
  checkpoints kept and later resumed): refused, with the ways forward.
- `--resume` continues the same run or nothing: the model and the data it was saved with must be
  the ones given now. A resumed checkpoint with another model would load what fits and drop the
  rest, and another tokenizer, corpus or sequence length would change what the sample offset
  means. Each difference is named (saved value, value now).
- A job's own run is continued, whatever its flags: torchrun restarts a job's processes (every
  node's, after any node's failure; a node started again joins the same job), and each attempt
  finds the run its first attempt began. The decision is made once per attempt by rank 0 and
  agreed by every rank (the Trainer), keyed by the job's identity: torchrun's rendezvous id
  (`--rdzv-id`, a fresh one per `--standalone` launch), written into config.json. Not by
  TORCHELASTIC_RESTART_COUNT: torchrun counts only the failed node's restarts, so a healthy node
  restarted beside it, or a node started again, counts 0, refused its own run and spent a restart;
  and a relaunch without --resume, refused on attempt 0, became a resume on attempt 1.

Torch-free: the launcher checks before torchrun starts a process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gridtrain.config import Config, ConfigError, ModelConfig, MoEConfig
from gridtrain.config_load import config_from_dict
from gridtrain.errors import BadInput, MissingInput
from gridtrain.inputs import read_json
from gridtrain.layout.dims import ParallelDims
from gridtrain.validate import model_problems

DATA_KEYS = ("corpus", "tokenizer", "seq_len", "val_fraction", "text_column", "mix")
"""The data settings a resume must keep: they decide which sample each step reads."""


@dataclass(frozen=True)
class RunRecord:
    """<run_dir>/config.json: the resolved configuration, the layout and the machine the run
    started on. The Trainer writes it (`write`); --resume's checks, `gridtrain plan --check` and
    `gridtrain export` read it (`load`)."""

    config: Config
    dims: ParallelDims | None
    """The layout; None only from `load(with_layout=False)` of a record that lacks it."""
    device: str = "cpu"
    threads: int = 1
    """torch's threads per rank."""
    cpu_count: int | None = None
    peak_flops: float | None = None
    """Per process, what MFU is reported against."""
    backend: str = "gloo"
    """What ran the collectives: 'gloo' (CPU: it has no reduce-scatter and all-reduces instead),
    'nccl', or 'fake' (a dry run: every collective as the code issues it)."""
    job_id: str | None = None
    """The job training into the run now (`job_id()`): its restarts continue the run."""

    def write(self, run_dir: Path) -> None:
        """Whole or not at all: a kill mid-write leaves the old record, and --resume still works."""
        record = {"config": dataclasses.asdict(self.config), "world_size": self.dims.world_size,
                  "dims": dataclasses.asdict(self.dims), "device": self.device, "threads": self.threads,
                  "cpu_count": self.cpu_count, "peak_flops": self.peak_flops, "backend": self.backend,
                  "job_id": self.job_id}
        path = Path(run_dir) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(record, indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, run_dir: Path, with_layout: bool = True) -> RunRecord:
        """The record of the run in `run_dir`, through the same checks as the command line: each
        key's type and range (config_load), and a model `gridtrain train` would build
        (validate.model_problems). A missing, damaged, foreign or crafted file is one line naming
        it (MissingInput, BadInput), not a KeyError three calls later or an allocation of
        terabytes. Without `with_layout`, the configuration is enough (what `export` needs)."""
        record, path = _read_record(run_dir), run_dir / "config.json"
        try:
            cfg = config_from_dict(record["config"])
            problems = model_problems(cfg.model.args(), cfg.data.seq_len)
            dims = ParallelDims(**record["dims"]) if with_layout or "dims" in record else None
        except ConfigError as err:
            raise BadInput(f"{path} does not hold a configuration of this gridtrain ({'; '.join(err.problems)})") from None
        except (KeyError, TypeError, ValueError) as err:
            raise BadInput(f"{path} is not a gridtrain run record ({type(err).__name__}: {err})") from None
        if problems:
            raise BadInput(f"{path} describes a model gridtrain does not build: {'; '.join(problems)}")
        return cls(cfg, dims, record.get("device", "cpu"), record.get("threads") or 1, record.get("cpu_count"),
                   record.get("peak_flops"), record.get("backend", "gloo"), record.get("job_id"))


def saved_record(run_dir: Path) -> dict | None:
    """The run's config.json as saved (a dict: it may come from another version), None if the
    directory holds no run."""
    if not (run_dir / "config.json").is_file():
        return None
    try:
        return _read_record(run_dir)
    except BadInput as err:
        raise ConfigError([f"{err}; move the directory aside or train into a new --run_dir"]) from None


def _read_record(run_dir: Path) -> dict:
    """<run_dir>/config.json, checked enough that its model can be built."""
    path = run_dir / "config.json"
    if not path.is_file():
        raise MissingInput(f"{run_dir} is not a gridtrain run directory (no config.json): give the run_dir "
                           "of a `gridtrain train` run")
    record = read_json(path, str(path))
    try:
        config_from_dict(record["config"])  # every key of the command line's, of its type
    except ConfigError as err:
        raise BadInput(f"{path} does not hold a configuration of this gridtrain ({'; '.join(err.problems)})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise BadInput(f"{path} is not a gridtrain run record ({type(err).__name__}: {err})") from None
    return record


def differences(saved: dict, cfg: Config) -> list[str]:
    """'key: saved X, now Y' for each model or data setting that differs from the saved run."""
    out = []
    model = saved.get("model", {})
    try:
        saved_model = ModelConfig(**{k: v for k, v in model.items() if k != "moe"}, moe=MoEConfig(**model.get("moe", {})))
        before = saved_model.args()
    except (KeyError, TypeError, ValueError) as err:
        return [f"model: the saved configuration does not describe a model gridtrain knows ({err})"]
    now = cfg.model.args()
    for field in dataclasses.fields(now):
        old, new = getattr(before, field.name), getattr(now, field.name)
        if old != new:
            out.append(f"model.{field.name}: saved {old!r}, now {new!r}")
    data = saved.get("data", {})
    for key in DATA_KEYS:
        if key in data and data[key] != getattr(cfg.data, key):
            out.append(f"data.{key}: saved {data[key]!r}, now {getattr(cfg.data, key)!r}")
    return out


def unwritable(path: Path) -> str | None:
    """Why `path` (a directory, existing or to be made) cannot be written, or None. Tried, not
    guessed from permission bits (root ignores them; a read-only mount does not show in them): a
    directory is made and removed in the nearest existing ancestor."""
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gridtrain-write-test-", dir=ancestor))
    except OSError as err:
        return f"{ancestor} cannot be written ({err.strerror})"
    return None


def job_id() -> str | None:
    """This job's identity: torchrun's rendezvous id (TORCHELASTIC_RUN_ID, the same on every node and
    in every attempt of a job), or None outside torchrun or under its default id 'none', which
    names no job."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return run_id if run_id not in ("", "none") else None


NEW, OWN, RESUME = "new", "own", "resume"
"""The run-directory decisions: start a new run; continue this job's own run (a restart: from its
newest checkpoint); resume another job's run (--resume, same model and data)."""


def run_dir_decision(cfg: Config, job: str | None, restarted: bool) -> str:
    """NEW, OWN or RESUME for a job `job` (`job_id()`) training into `cfg.run_dir`, or ConfigError
    refusing it (module docstring). `restarted` (torchrun restarted some rank) decides what is
    this job's own run only where the job has no identity (torchrun's default --rdzv-id)."""
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError([f"run_dir {run_dir} is a file, not a directory: give another --run_dir"])
    why = unwritable(run_dir)
    if why:
        raise ConfigError([f"run_dir {run_dir}: {why}: give another --run_dir"])
    record = saved_record(run_dir)
    if record is None:
        return NEW
    if (record.get("job_id") == job) if job is not None else restarted:
        return OWN
    if not cfg.checkpoint.resume:
        raise ConfigError([f"run_dir {run_dir} already holds a run (its config.json): continue it with "
                           f"--resume, or train into a new --run_dir (or move {run_dir} aside first)"])
    diffs = differences(record.get("config", {}), cfg)
    if diffs:
        raise ConfigError([f"--resume would continue the run in {run_dir} with another model or data, which "
                           "it refuses (to train this configuration, give a new --run_dir):", *diffs])
    return RESUME


def check_run_dir(cfg: Config) -> None:
    """Refuse, before any process starts, a run that would mix with the one already in `run_dir`
    (module docstring): the launcher's check, for a job that has not started yet."""
    run_dir_decision(cfg, None, False)
