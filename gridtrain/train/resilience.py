"""Keeping a run alive and honest at scale: fault injection (for the tests that prove recovery),
the guards on non-finite and spiking losses, collective timeouts that name the stalled rank, and
the checkpoint cadence chosen from the measured save time (Young/Daly).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import logging
import math
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gridtrain.config import FaultConfig
from gridtrain.parallel.accounting import CollectiveLog
from gridtrain.plan.reliability import daly_interval, young_interval

log = logging.getLogger("gridtrain")


def restart_count() -> int:
    """How many times torchrun has restarted this run (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def inject_fault(fault: FaultConfig, rank: int, step: int, restarted: bool) -> None:
    """Fire the configured fault if `step` (the one about to run, counted from 1) is
    fault.at_step, on the first attempt only (`restarted`: torchrun restarted any rank):
    SIGKILL (no cleanup, like a lost node) or an endless sleep (a stalled rank that its peers
    must detect)."""
    if restarted or fault.at_step == 0 or step != fault.at_step:
        return
    if rank == fault.kill_rank:
        log.warning("fault injection: rank %d kills itself (SIGKILL) at the start of step %d", rank, step)
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == fault.hang_rank:
        log.warning("fault injection: rank %d stops responding at the start of step %d", rank, step)
        # It still dies of torchrun's SIGTERM once a peer has given up: the run ends at once
        # rather than after torchrun's 30 s wait for a rank that handles the signal.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:
            time.sleep(3600)


def slow_down(fault: FaultConfig, rank: int, step: int, cpu_seconds: float) -> None:
    """A straggler for the tests: fault.slow_rank, from fault.at_step on (every attempt), burns
    (fault.slow_factor - 1) x the CPU seconds its forward and backward took, after them."""
    if rank != fault.slow_rank or fault.at_step == 0 or step < fault.at_step:
        return
    end = time.process_time() + (fault.slow_factor - 1) * cpu_seconds
    while time.process_time() < end:
        pass


class TrainingDiverged(RuntimeError):
    """Too many steps in a row with a non-finite loss or gradient norm."""


class Guard:
    """Skips updates whose loss or gradient norm is not finite (every rank sees the same global
    values, so all skip together), stops the run after `max_bad` such steps in a row, and logs a
    loss more than `zscore` standard deviations above the mean of the last `window` steps."""

    def __init__(self, max_bad: int, zscore: float, window: int = 100, warmup: int = 20) -> None:
        self.max_bad, self.zscore, self.warmup = max_bad, zscore, warmup
        self.losses: collections.deque[float] = collections.deque(maxlen=window)
        self.in_a_row = 0
        self.skipped = 0
        self.spikes = 0

    def admit(self, step: int, loss: float, grad_norm: float) -> bool:
        """Whether step `step` may update the weights."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.in_a_row += 1
            self.skipped += 1
            log.warning("step %d: loss %s, gradient norm %s: update skipped (%d in a row, %d in all)",
                        step, loss, grad_norm, self.in_a_row, self.skipped)
            if self.in_a_row >= self.max_bad:
                raise TrainingDiverged(
                    f"{self.in_a_row} steps in a row (up to step {step}) had a non-finite loss or gradient "
                    f"norm (train.max_bad_steps = {self.max_bad}): lower train.lr, raise train.warmup_steps, "
                    "use bf16 instead of fp16, or resume from an earlier checkpoint")
            return False
        self.in_a_row = 0
        if self.zscore > 0 and len(self.losses) >= self.warmup:
            mean, std = statistics.fmean(self.losses), statistics.pstdev(self.losses)
            if std > 0 and (loss - mean) / std > self.zscore:
                self.spikes += 1
                log.warning("step %d: loss spike: %.4f is %.1f standard deviations above the mean %.4f of "
                            "the last %d steps (train.spike_zscore = %g)", step, loss, (loss - mean) / std,
                            mean, len(self.losses), self.zscore)
        self.losses.append(loss)
        return True

    def metrics(self) -> dict[str, float]:
        return {"guard/skipped_total": float(self.skipped), "guard/spikes_total": float(self.spikes)}


# -- collective timeouts ---------------------------------------------------------------------


class CollectiveTimeout(RuntimeError):
    """A collective failed or waited past train.collective_timeout_s; the message names the
    stalled ranks, the collective and the step."""


def set_timeouts(groups: list[dist.ProcessGroup], seconds: float) -> None:
    """Every group of the run gives up after `seconds` (sub-groups otherwise keep torch's
    30-minute default for gloo, whatever the world's timeout)."""
    timeout = datetime.timedelta(seconds=seconds)
    for group in {id(g): g for g in groups}.values():
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def is_comm_failure(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, dist.DistError) or any(
        s in text for s in ("Timed out", "timed out", "Connection closed by peer", "Connection reset"))


class ProgressBoard:
    """Each rank posts the step it starts to the rendezvous store (one small write per step), so
    that a rank whose collective timed out can tell which peers never reached that step; and on a
    failure each rank answers a roll call there, so that a peer which reached the step but went
    silent inside it (stopped with SIGSTOP, or dead) is named too."""

    PREFIX = "gridtrain/progress/"
    FAILED = "gridtrain/failed/"
    READ = "gridtrain/read/"

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.store = dist.distributed_c10d._get_default_store()

    def post(self, step: int) -> None:
        self.store.set(f"{self.PREFIX}{self.rank}", str(step))

    def last_steps(self) -> dict[int, int | None] | None:
        """Each rank's last posted step (None: never posted), or None if the store did not answer
        within 5 s: its host is gone or stopped (rank 0, or node 0's torchrun agent)."""
        steps: dict[int, int | None] = dict.fromkeys(range(self.world_size))
        try:
            self.store.set_timeout(datetime.timedelta(seconds=5))
            keys = [f"{self.PREFIX}{r}" for r in range(self.world_size)]
            posted = [r for r, key in enumerate(keys) if self.store.check([key])]
            for r, value in zip(posted, self.store.multi_get([keys[r] for r in posted])):
                steps[r] = int(value)
            self.store.set(f"{self.READ}{self.rank}", "1")  # what rank 0 waits for before it leaves
        except Exception:  # a store that cannot be reached (or answers garbage) tells nothing of the peers
            return None
        return steps

    def answer(self) -> None:
        """Answer the failure roll call without waiting for it: a rank whose peer dropped the
        connection is alive and failed too, and must not be named silent by those who wait."""
        with contextlib.suppress(Exception):  # the store's host is gone: last_steps says so
            self.store.set_timeout(datetime.timedelta(seconds=5))
            self.store.set(f"{self.FAILED}{self.rank}", "1")

    def roll_call(self, wait_s: float) -> set[int] | None:
        """Answer the failure roll call, and the ranks that answered until every rank had, or
        `wait_s` passed without a new answer (a live rank that entered the collective late, such
        as a straggler, times out as late: it is still heard); None if the store does not answer."""
        try:
            self.store.set_timeout(datetime.timedelta(seconds=5))
            self.store.set(f"{self.FAILED}{self.rank}", "1")
            answered: set[int] = set()
            deadline = time.monotonic() + wait_s
            while True:
                now = self.answered()
                if now - answered:
                    answered, deadline = now, time.monotonic() + wait_s
                if len(answered) == self.world_size or time.monotonic() > deadline:
                    return answered
                time.sleep(0.2)
        except Exception:  # the store's host is gone: last_steps says so
            return None

    def answered(self) -> set[int]:
        """The ranks that have answered the failure roll call so far."""
        return {r for r in range(self.world_size) if self.store.check([f"{self.FAILED}{r}"])}

    def linger(self, wait_s: float) -> None:
        """Stay until every rank that answered the roll call has read the board, waiting at most
        `wait_s` + 2 s after the last new answer (each answer prolongs its peers' roll calls by
        `wait_s`): `gridtrain train --nproc` runs without torchrun's agent store, so rank 0's
        process hosts the store, and its exit would cut short the diagnosis of a peer that timed
        out later."""
        answered: set[int] = set()
        deadline = time.monotonic() + wait_s + 2.0
        with contextlib.suppress(Exception):
            while time.monotonic() < deadline:
                now = self.answered()
                if now - answered:
                    answered, deadline = now, time.monotonic() + wait_s + 2.0
                if all(self.store.check([f"{self.READ}{r}"]) for r in answered):
                    return
                time.sleep(0.05)


def store_address() -> str:
    """Where this job's store is (MASTER_ADDR:MASTER_PORT, what torchrun gives every rank)."""
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def collective_failure(err: BaseException, rank: int, step: int, timeout_s: float, board: ProgressBoard | None,
                       comm_log: CollectiveLog | None, run_dir: Path, doing: str) -> CollectiveTimeout:
    """Write this rank's last collectives to <run_dir>/failures/rank<r>.json and build the error;
    `step` is the last step any rank may have started, `doing` what this rank was at."""
    records = comm_log.last(20) if comm_log else []
    timed_out = "timed out" in str(err).lower()
    # A timeout ends every live rank's wait within about a step's imbalance of the others: a roll
    # call tells the silent one. A lost connection reaches the ranks one after another: there it
    # would name the slow.
    wait_s = min(max(3.0, timeout_s / 2), 30.0)
    answered = board.roll_call(wait_s) if board and timed_out else None
    steps = board.last_steps() if board else {}
    store_lost = steps is None
    # A lost connection often comes from a peer whose own wait just timed out and closed its
    # sockets: this rank answers, so that the peer's roll call does not name it silent (unless the
    # store is lost: the answer would wait 5 s more for it).
    if board and not timed_out and not store_lost:
        board.answer()
    stalled = {r: s for r, s in (steps or {}).items() if r != rank and (s is None or s < step)}
    silent = sorted(r for r in (steps or {}) if r not in stalled and answered is not None and r not in answered)
    dump_flight_recorder(Path(run_dir) / "failures", rank)
    path = Path(run_dir) / "failures" / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "step": step, "doing": doing, "error": str(err)[:2000],
                                "ranks_last_step": steps,
                                "last_collectives": records}, indent=2))
    last = records[-1] if records else None
    what = (f"{last['kind']} over '{last['axis']}' (sequence {last['seq']}, {last['bytes']:,} bytes)"
            if last else "a collective")
    who = "; ".join(f"rank {r} never reached step {step} (last started: "
                    f"{'none' if s is None else f'step {s}'})" for r, s in sorted(stalled.items()))
    if silent and not stalled:
        who = "; ".join(f"rank {r} started step {step} but went silent inside it (stopped or dead: every other "
                        "rank's collective failed, it never said so)" for r in silent)
    if store_lost:
        who = (f"the job's store at {store_address()} no longer answers: its host (rank 0's process, or node 0's "
               "torchrun agent) is gone or stopped; without node 0's agent no node can restart the job: start "
               "it again with --resume")
    if board and rank == 0 and not store_lost:
        board.linger(wait_s)
    how = (f"gave up on {what} {doing} after {timeout_s:g} s (train.collective_timeout_s)" if timed_out
           else f"lost a peer in {what} {doing}")
    return CollectiveTimeout(
        f"rank {rank} {how}: {who or 'no peer is behind: a peer failed inside the step'}. "
        f"This rank's last collectives: {path}. Cause: {str(err).splitlines()[0][:300]}")


def dump_flight_recorder(folder: Path, rank: int) -> None:
    """This rank's flight recorder (torch's own pickle, with stack traces) as
    <folder>/fr_trace_<rank>, what torch's analyser reads: `python -m
    torch.distributed.flight_recorder.fr_trace <folder> --prefix fr_trace_`."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"fr_trace_{rank}").write_bytes(torch._C._distributed_c10d._dump_fr_trace(True, True, False))
    except Exception as err:  # the error being reported matters more than its trace
        log.warning("flight recorder of rank %d not written: %s", rank, err)


# -- checkpoint cadence -----------------------------------------------------------------------


def auto_interval(save_s: float, step_s: float, mtbf_hours: float) -> tuple[int, str]:
    """Steps between checkpoints from Daly's optimal interval for a save of `save_s` and a job
    MTBF, and the reasoning as one line."""
    mtbf_s = mtbf_hours * 3600
    daly, young = daly_interval(save_s, mtbf_s), young_interval(save_s, mtbf_s)
    steps = max(1, round(daly / step_s))
    return steps, (f"checkpoint.interval auto: a save takes {save_s:.3f} s, a step {step_s:.3f} s, the job's "
                   f"MTBF is {mtbf_hours:g} h (checkpoint.mtbf_hours): Daly's interval {daly:.1f} s "
                   f"(Young's {young:.1f} s) = every {steps} steps")


class StopSignals:
    """SIGTERM and SIGUSR1, what SLURM (`--signal`), Kubernetes and torchrun send before they stop
    a job: while caught (main thread only), a signal is noted in `signum` for the training loop,
    which saves and stops after its step; a watchdog then exits as the signal would have once
    `grace_s` has passed (0: at once, without saving)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signum: int | None = None
        self.previous: dict[int, object] = {}
        self.watchdog: threading.Timer | None = None

    def catch(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.getsignal(sig) for sig in self.SIGNALS}
            for sig in self.SIGNALS:
                signal.signal(sig, self.handle)

    def release(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        if self.grace_s <= 0:
            os._exit(128 + signum)
        self.watchdog = threading.Timer(self.grace_s, os._exit, args=(128 + signum,))
        self.watchdog.daemon = True
        self.watchdog.start()

    def disarm(self) -> None:
        """Forget a caught signal and stop its watchdog: for a process that goes on after the
        save (the parity harness's SIGTERM leg), not for a run, which exits."""
        if self.watchdog is not None:
            self.watchdog.cancel()
        self.signum, self.watchdog = None, None
