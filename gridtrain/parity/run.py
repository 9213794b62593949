"""Running parity cases: many layouts in one torchrun launch (starting processes dominates the
time), and the single-process reference each is compared with.

    python -m gridtrain.parity.run SPEC.json OUT_DIR     (under torchrun: the worker)

SPEC.json maps a case name to its config overrides. For each case the worker trains the steps and
saves, from one rank per pipeline rank (data- and tensor-parallel coordinate 0), the per-step
losses, the per-step gradient norms (before clipping) and the gathered full weights of the stages
that rank holds, initial and final: OUT_DIR/NAME.pp<r>.pt. A case whose overrides hold LEG runs
the second leg: after all steps but the last it validates in its layout, saves a checkpoint as a
stop signal does (`save_on_sigterm`), and resumes it for the last step under the layout LEG
names, in the same launch (OUT_DIR/NAME.leg.pp<r>.pt; for one process, the comparing process
resumes it). For a case whose overrides hold MEASURE = true, from every rank the tensor bytes it
held at most while the Trainer was built and during the first step:
OUT_DIR/NAME.rank<r>.bytes.json (a dispatch mode follows every op then).
A case that raises leaves OUT_DIR/NAME.error.txt (rank 0) and ends the launch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from gridtrain.config_load import load_config
from gridtrain.data.corpus import remember_readable_sources
from gridtrain.train.live_bytes import LiveBytes

MEASURE = "measure_bytes"
"""A case key, not a config key: measure the case's tensor bytes (`write_bytes`)."""
LEG = "resume_leg"
"""A case key, not a config key: after train.steps - 1 steps, the second leg (`run_leg`). Its value
is the overrides of the layout the checkpoint resumes under for the last step, or None for one
process (then the comparing process resumes it: `resume_in_one_process`)."""


@dataclass
class Result:
    """What a run of a few steps produced, as one process would hold it. With the second leg:
    `val_loss` after the first leg's steps, and `leg`, the whole run with its last step taken
    after a checkpoint round trip under `resumed_as` (its weights those after that step)."""

    losses: list[float]
    grad_norms: list[float]
    weights: dict[str, torch.Tensor]
    lrs: list[float]
    initial: dict[str, torch.Tensor]
    val_loss: float | None = None
    leg: Result | None = None
    resumed_as: str = ""
    run_dir: Path | None = None
    seconds: dict[str, float] | None = None
    """Wall seconds of the case's parts in its launch (first leg, validation and save, second leg)."""


def run_case(name: str, overrides: dict[str, object], out: Path) -> None:
    import torch.distributed as dist

    from gridtrain.train.trainer import Trainer

    overrides = dict(overrides)
    measure = bool(overrides.pop(MEASURE, False))
    with_leg, resume_as = LEG in overrides, overrides.pop(LEG, None)
    cfg = load_config(None, {**overrides, "run_dir": str(out / name)})
    with LiveBytes() if measure else contextlib.nullcontext() as live:
        trainer = Trainer(cfg)
    if measure:
        built = live.peak
        live.reset_peak()
    if trainer.world.rank == 0:
        trainer.write_record()
    initial = gathered_weights(trainer)
    started = time.perf_counter()
    losses, norms, lrs, records = [], [], [], []
    for step in range(cfg.train.steps - with_leg):
        if step == 0 and measure:
            with live:
                metrics = trainer.train_step()
            write_bytes(out / f"{name}.rank{trainer.world.rank}.bytes.json", trainer, built, live.peak)
        else:
            metrics = trainer.train_step()
        losses.append(metrics["loss/train"])
        norms.append(metrics["grad/norm"])
        lrs.append(metrics["lr"])
        records.append(json.dumps({"step": trainer.step, **metrics}))
    if trainer.world.rank == 0:  # what Trainer.run logs, for `gridtrain plan --check`'s step time
        (out / name / "metrics.jsonl").write_text("\n".join(records) + "\n")
    weights = gathered_weights(trainer)
    result = {"losses": losses, "grad_norms": norms, "lrs": lrs, "weights": weights, "initial": initial}
    writes = trainer.coords["dp"] == 0 and trainer.coords["tp"] == 0 and trainer.coords["cp"] == 0
    pp_rank = trainer.coords["pp"]
    seconds = {"steps": time.perf_counter() - started}
    if with_leg:
        result["val_loss"] = trainer.evaluate()["loss/val"]
        save_on_sigterm(trainer)
        seconds["validate_save"] = time.perf_counter() - started - seconds["steps"]
        del trainer
        if resume_as is not None:
            same = {k: v for k, v in overrides.items() if not k.startswith("parallel.")}
            run_leg(name, {**same, **resume_as, "run_dir": str(out / name)}, out)
            seconds["resume_step"] = time.perf_counter() - started - sum(seconds.values())
    result["seconds"] = seconds
    if writes:
        torch.save(result, out / f"{name}.pp{pp_rank}.pt")
    if dist.is_initialized():
        dist.barrier()


def save_on_sigterm(trainer) -> None:  # noqa: ANN001 - a Trainer
    """The first leg's checkpoint, saved as a job's stop signal saves it: rank 0 alone receives
    SIGTERM, and every rank learns it after the step (`Trainer.stop_if_signalled`), saves and
    stops. The second leg resumes this checkpoint, so the stop-signal save of every layout is
    proven to resume."""
    from gridtrain.checkpoint.checkpointer import Stopped

    signals = trainer.checkpointer.signals
    signals.catch()
    try:
        if trainer.world.rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        trainer.stop_if_signalled()
        raise RuntimeError(f"SIGTERM after step {trainer.step} did not stop the run")
    except Stopped:
        pass
    finally:
        signals.disarm()
        signals.release()


def run_leg(name: str, overrides: dict[str, object], out: Path) -> None:
    """The second leg's last step in this launch: resume the case's checkpoint under another
    layout of the same world size (`overrides`), take one step, and save its loss, gradient norm,
    learning rate and the weights after it: OUT_DIR/NAME.leg.pp<r>.pt."""
    from gridtrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, {**overrides, "checkpoint.resume": True}))
    metrics = trainer.train_step()
    weights = gathered_weights(trainer)
    if trainer.coords["dp"] == 0 and trainer.coords["tp"] == 0 and trainer.coords["cp"] == 0:
        torch.save({"loss": metrics["loss/train"], "grad_norm": metrics["grad/norm"], "lr": metrics["lr"],
                    "weights": weights, "step": trainer.step}, out / f"{name}.leg.pp{trainer.coords['pp']}.pt")


def resume_in_one_process(first: Result, overrides: dict[str, object]) -> Result:
    """The second leg in one process: the case's checkpoint (in `first.run_dir`) resumed without
    parallelism for its last step; `first`'s steps and this step as one Result."""
    from gridtrain.train.trainer import Trainer

    one = {k: v for k, v in overrides.items() if not k.startswith("parallel.") and k not in (LEG, MEASURE)}
    trainer = Trainer(load_config(None, {**one, "run_dir": str(first.run_dir), "checkpoint.resume": True}))
    metrics = trainer.train_step()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return _whole(first, metrics["loss/train"], metrics["grad/norm"], metrics["lr"], weights)


def _whole(first: Result, loss: float, norm: float, lr: float, weights: dict[str, torch.Tensor]) -> Result:
    return Result(first.losses + [loss], first.grad_norms + [norm], weights, first.lrs + [lr], first.initial)


def write_bytes(path: Path, trainer, built: int, stepped: int) -> None:  # noqa: ANN001 - a Trainer
    """What this rank held, measured (LiveBytes): the peak tensor bytes while the Trainer was
    built and during the first step; and the bytes of its parameters and optimizer state after
    that step (its gradients, as many bytes as its parameters, are freed by then)."""
    from gridtrain.parallel.accounting import optimizer_bytes, param_bytes

    path.write_text(json.dumps({"build_peak": built, "step_peak": stepped,
                                "params": param_bytes(trainer.pmodel.parameters()),
                                "optimizer": optimizer_bytes(trainer.optimizers)}))


def gathered_weights(trainer) -> dict[str, torch.Tensor]:  # noqa: ANN001 - a Trainer
    """The full weights of the stages this rank holds, gathered over the data- and
    tensor-parallel ranks (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights: dict[str, torch.Tensor] = {}
    for part in trainer.pmodel.parts:
        full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        weights.update({k: v.detach().cpu().clone() for k, v in full.items()})
    return weights


def worker(spec_path: Path, out: Path) -> None:
    """Run every case of the spec in this torchrun launch, in order."""
    import torch.distributed as dist

    spec = json.loads(spec_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    remember_readable_sources()  # every case reads the same corpus, which nothing writes meanwhile
    for name, overrides in spec.items():
        try:
            run_case(name, overrides, out)
        except Exception:
            if int(os.environ.get("RANK", 0)) == 0:
                (out / f"{name}.error.txt").write_text(traceback.format_exc())
            raise
        forget_case_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


def forget_case_groups() -> None:
    """Destroy the process groups a finished case made, but the default group and its meshes'
    (`gridtrain.parallel.mesh.build_mesh` keeps them for the next case of that shape). torch keeps
    every group made, and each slows the next one's creation and every read of the flight
    recorder (which lists every group). Measured on 40 runs of one 2-rank zero-bubble case in a
    launch: the 40th took 1.45 s against 0.5 s for the 2nd; with the meshes kept and the rest
    destroyed, every one 0.44 to 0.51 s."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from gridtrain.parallel.mesh import mesh_groups

    if dist.is_initialized():
        kept = {c10d.GroupMember.WORLD, *mesh_groups()}
        for group in [g for g in list(c10d._world.pg_map) if g not in kept]:
            dist.destroy_process_group(group)


_RUNNING: set[subprocess.Popen] = set()
"""The launches under way in this process (`launch`), for `kill_launches`."""


def kill_launches() -> None:
    """Kill every launch under way in this process, torchrun and the workers it started: each is
    a session of its own, which an interrupt or an error of this process does not reach."""
    for proc in list(_RUNNING):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def launch(world: int, spec: dict[str, dict[str, object]], out: Path, timeout_s: float = 3600) -> subprocess.CompletedProcess:
    """Run the spec's cases in one torchrun launch of `world` processes, one thread each."""
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "gridtrain.parity.run", str(spec_path), str(out)]
    root = str(Path(__file__).resolve().parents[2])
    # The step accounting reads the whole flight recorder at every step it accounts, and a launch
    # of many cases soon fills it: about 90 ms a read at 4,000 entries, so a case accounted on
    # every step took 2 s late in a launch of 30 that took 0.8 s early. The largest step of the
    # tests' cases made 215 collectives; a window that overflows the recorder is an error, not a
    # wrong count. Set over the caller's environment: importing gridtrain.train.distributed sets
    # 20,000 there, which CI's parity launches inherited (a full one is read 5x slower).
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "1000", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        _RUNNING.add(proc)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every worker it started
            stdout, stderr = proc.communicate()
            return subprocess.CompletedProcess(cmd, 124, stdout, f"{stderr}\nlaunch timed out after {timeout_s:.0f} s")
        finally:
            _RUNNING.discard(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def load_result(out: Path, name: str) -> Result | None:
    """A case's result, merged over its pipeline ranks (and its second leg's); None if it wrote none."""
    first = _merged(sorted(out.glob(f"{name}.pp*.pt")))
    if first is None:
        return None
    result = Result(first["losses"], first["grad_norms"], first["weights"], first["lrs"], first["initial"],
                    first.get("val_loss"), run_dir=out / name, seconds=first.get("seconds"))
    leg = _merged(sorted(out.glob(f"{name}.leg.pp*.pt")))
    if leg is not None:
        result.leg = _whole(result, leg["loss"], leg["grad_norm"], leg["lr"], leg["weights"])
    return result


def _merged(files: list[Path]) -> dict | None:
    """The saved dicts of a case's pipeline ranks as one: weights (and initial weights) merged,
    everything else from the last."""
    if not files:
        return None
    merged: dict = {"weights": {}, "initial": {}}
    for f in files:
        part = torch.load(f, weights_only=True)
        weights, initial = part.pop("weights"), part.pop("initial", {})
        merged["weights"].update(weights)
        merged["initial"].update(initial)
        merged.update(part)
    return merged


def run_reference(overrides: dict[str, object], leg: bool = False) -> Result:
    """The same run in this process (no process group). With `leg`, as a case with the second
    leg sees it: the first train.steps - 1 steps (weights after them), the validation loss there,
    and `leg`, the whole run (weights after the last step)."""
    from gridtrain.train.trainer import Trainer

    cfg = load_config(None, overrides)
    trainer = Trainer(cfg)
    initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    metrics = [trainer.train_step() for _ in range(cfg.train.steps - leg)]
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    result = Result([m["loss/train"] for m in metrics], [m["grad/norm"] for m in metrics], weights,
                    [m["lr"] for m in metrics], initial)
    if leg:
        result.val_loss = trainer.evaluate()["loss/val"]
        last = trainer.train_step()
        after = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        result.leg = _whole(result, last["loss/train"], last["grad/norm"], last["lr"], after)
    return result


if __name__ == "__main__":
    worker(Path(sys.argv[1]), Path(sys.argv[2]))
