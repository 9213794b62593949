"""Guards, fault-injection rules and the automatic checkpoint cadence, in one process."""

from __future__ import annotations

import json
import logging
import math
import re
import time

import pytest
import torch
import torch.distributed as dist

from gridtrain.config import ConfigError, FaultConfig
from gridtrain.config_load import load_config
from gridtrain.validate import validate
from gridtrain.train.resilience import Guard, TrainingDiverged, auto_interval, inject_fault


def test_guard_skips_non_finite_steps_and_stops_after_max_in_a_row(caplog):
    guard = Guard(max_bad=3, zscore=0)
    assert guard.admit(1, 2.0, 1.0)
    with caplog.at_level(logging.WARNING, logger="gridtrain"):
        assert not guard.admit(2, math.nan, 1.0)
        assert not guard.admit(3, 2.0, math.inf)
    assert "step 3: loss 2.0, gradient norm inf: update skipped (2 in a row, 2 in all)" in caplog.text
    assert guard.admit(4, 2.0, 1.0)  # a finite step resets the count in a row, not the total
    assert not guard.admit(5, math.nan, math.nan) and not guard.admit(6, math.nan, 1.0)
    with pytest.raises(TrainingDiverged, match=r"3 steps in a row \(up to step 7\).*train.max_bad_steps = 3"):
        guard.admit(7, math.inf, 1.0)
    assert guard.metrics()["guard/skipped_total"] == 5.0


def test_guard_logs_a_loss_spike_by_z_score(caplog):
    """After 20 losses alternating 2.0 and 2.2 (mean 2.1, std 0.1), 2.6 is 5 deviations up (no
    spike at 6), 2.8 is 7 (a spike, logged; the update is not skipped)."""
    guards = [Guard(max_bad=5, zscore=6.0) for _ in range(2)]
    for guard in guards:
        for i in range(20):
            guard.admit(i + 1, 2.0 + 0.2 * (i % 2), 1.0)
    with caplog.at_level(logging.WARNING, logger="gridtrain"):
        assert guards[0].admit(21, 2.6, 1.0)
        assert guards[1].admit(21, 2.8, 1.0)
    assert guards[0].metrics()["guard/spikes_total"] == 0.0
    assert guards[1].metrics()["guard/spikes_total"] == 1.0
    assert "step 21: loss spike: 2.8000 is 7.0 standard deviations above the mean 2.1000 of the last 20" in caplog.text


def test_auto_interval_is_dalys_in_steps():
    """C = 2 s, M = 1 h: Young sqrt(2 x 2 x 3600) = 120 s; Daly 120 (1 + sqrt(2/7200)/3 + (2/7200)/9) - 2
    = 118.67 s, at 0.5 s per step: every 237 steps."""
    steps, reason = auto_interval(2.0, 0.5, 1.0)
    assert steps == 237
    assert "Daly's interval 118.7 s (Young's 120.0 s) = every 237 steps" in reason
    assert auto_interval(10.0, 100.0, 0.001)[0] == 1  # never less than every step


def test_fault_fires_only_on_its_step_and_first_attempt(monkeypatch):
    fault = FaultConfig(at_step=3, kill_rank=1)
    killed = []
    monkeypatch.setattr("os.kill", lambda pid, sig: killed.append(sig))
    inject_fault(fault, rank=1, step=2, restarted=False)
    inject_fault(fault, rank=0, step=3, restarted=False)
    inject_fault(fault, rank=1, step=3, restarted=True)
    assert killed == []
    inject_fault(fault, rank=1, step=3, restarted=False)
    assert len(killed) == 1


def test_resilience_settings_are_validated():
    cfg = load_config(None, {"checkpoint.interval": "sometimes", "checkpoint.on_save_error": "retry",
                             "fault.kill_rank": 2, "train.collective_timeout_s": 0, "checkpoint.mtbf_hours": -1,
                             "fault.slow_rank": 0, "fault.slow_factor": 0.5, "metrics.straggler_every": -1})
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    text = str(err.value)
    assert "checkpoint.interval = 'sometimes' is neither a number of steps nor 'auto'" in text
    assert "checkpoint.on_save_error = 'retry' is not one of stop, continue" in text
    assert "fault.kill_rank = 2 is not a rank of this world (0..0)" in text
    assert "train.collective_timeout_s = 0.0 must be > 0" in text
    assert "checkpoint.mtbf_hours = -1.0 must be > 0" in text
    assert "fault.slow_factor = 0.5 must be >= 1 (2: half speed)" in text
    assert "fault.slow_rank = 0 needs fault.at_step in [1, train.steps" in text
    assert "metrics.straggler_every" in text
    assert load_config(None, {"checkpoint.interval": "auto"}).checkpoint.interval == "auto"
    assert load_config(None, {"checkpoint.interval": "12"}).checkpoint.interval == 12


def test_trainer_skips_a_non_finite_step_without_touching_the_weights(tmp_path, make_config, monkeypatch):
    from gridtrain.train.trainer import Trainer

    trainer = Trainer(make_config(tmp_path, **{"train.max_bad_steps": 2}))
    trainer.train_step()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    real = trainer.forward_backward

    def poisoned() -> torch.Tensor:
        loss = real()
        next(trainer.model.parameters()).grad.fill_(math.nan)
        return loss

    monkeypatch.setattr(trainer, "forward_backward", poisoned)
    metrics = trainer.train_step()
    assert metrics["optim/skipped_steps"] == 1.0 and metrics["guard/skipped_total"] == 1.0
    assert trainer.step == 2  # the batch is consumed: the next step reads the next one
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, before[key]), key
    with pytest.raises(TrainingDiverged):
        trainer.train_step()


def test_resume_skips_a_corrupted_checkpoint_for_the_previous_one(tmp_path, make_config, caplog):
    """A flipped byte in the newest checkpoint's shard: the trainer warns, names it, and resumes
    from the one before, which then trains on exactly as the uninterrupted run did."""
    from gridtrain.train.trainer import Trainer

    cfg = make_config(tmp_path, **{"checkpoint.interval": 2, "train.steps": 4})
    Trainer(cfg).run()
    shard = next((tmp_path / "run" / "checkpoints" / "step-0000004").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        resumed = Trainer(make_config(tmp_path, **{"checkpoint.interval": 2, "train.steps": 4,
                                                   "checkpoint.resume": True}))
    assert resumed.step == 2
    assert "step-0000004 skipped" in caplog.text and "sha256" in caplog.text


def test_failed_saves_keep_the_earlier_checkpoint_and_follow_the_policy(tmp_path, make_config, monkeypatch, caplog):
    """A disk that fills after step 2's checkpoint: with on_save_error 'continue' the run
    trains to the end, logs each failure and, its last save failed too, ends with an error (it
    once exited 0); with 'stop' it ends at the first failure. Step 2's checkpoint stays intact
    and loadable either way, and no half-written directory is left."""
    from gridtrain.checkpoint.store import CheckpointSaveError, latest_valid_checkpoint
    from gridtrain.train.trainer import Trainer

    base = {"checkpoint.interval": 2, "train.steps": 2}
    Trainer(make_config(tmp_path, **base)).run()
    monkeypatch.setenv("GRIDTRAIN_FAULT_SAVE_ERROR", "ENOSPC")
    more = {**base, "train.steps": 4, "checkpoint.resume": True}
    with caplog.at_level(logging.ERROR), pytest.raises(CheckpointSaveError, match="trained to step 4 but its last "
                                                          "checkpoint could not be saved"):
        Trainer(make_config(tmp_path, **more, **{"checkpoint.on_save_error": "continue"})).run()
    assert "No space left on device" in caplog.text and "training goes on" in caplog.text
    trained = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert trained[-2:] == [3, 4]
    with pytest.raises(CheckpointSaveError, match="No space left on device"):
        Trainer(make_config(tmp_path, **more)).run()
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-0000002"]
    assert latest_valid_checkpoint(root)[0] == root / "step-0000002"


def test_async_save_writes_the_same_checkpoints(tmp_path, make_config, checkpoint_weights):
    from gridtrain.train.trainer import Trainer

    for name, background in (("sync", False), ("async", True)):
        Trainer(make_config(tmp_path, run_dir=str(tmp_path / name),
                            **{"checkpoint.interval": 2, "checkpoint.async_save": background})).run()
    for step in ("step-0000002", "step-0000004"):
        sync, background = (checkpoint_weights(tmp_path / n / "checkpoints" / step) for n in ("sync", "async"))
        for key in sync:
            assert torch.equal(sync[key], background[key]), (step, key)


def test_auto_interval_times_a_save_after_the_warm_up(tmp_path, make_config, caplog):
    from gridtrain.checkpoint.checkpointer import AUTO_AFTER
    from gridtrain.train.trainer import Trainer

    with caplog.at_level(logging.INFO, logger="gridtrain"):
        trainer = Trainer(make_config(tmp_path, **{"checkpoint.interval": "auto", "checkpoint.mtbf_hours": 1e-4,
                                                   "train.steps": AUTO_AFTER + 1}))
        trainer.run()
    assert (tmp_path / "run" / "checkpoints" / f"step-{AUTO_AFTER:07d}").is_dir()
    match = re.search(r"checkpoint.interval auto: a save takes ([\d.]+) s, a step ([\d.]+) s, the job's MTBF is "
                      r"0.0001 h .* = every (\d+) steps", caplog.text)
    assert match, caplog.text
    step_s, steps = float(match[2]), int(match[3])
    assert steps == trainer.checkpointer.interval
    # By hand, Daly's interval never exceeds the MTBF, here 1e-4 h = 0.36 s: it is M when C >= 2M,
    # and with u = sqrt(C / 2M) < 1 it is 2M (u - 2u^2/3 + u^3/9), increasing in u, at most 8M/9.
    # So the cadence is one step, or round(interval / step) <= 0.36 s / step + 1/2 (the log
    # rounds the step time to 1 ms, hence the 0.5 ms of slack).
    assert steps == 1 or steps - 0.5 <= 0.36 / (step_s - 0.0005), (steps, step_s)


def test_async_save_is_committed_once_written_without_waiting_for_the_next(tmp_path, make_config):
    import time

    from gridtrain.checkpoint.manifest import verify
    from gridtrain.train.trainer import Trainer

    trainer = Trainer(make_config(tmp_path, **{"checkpoint.async_save": True}))
    trainer.train_step()
    trainer.save()
    committed = tmp_path / "run" / "checkpoints" / "step-0000001"
    assert not committed.exists()  # written in the background, not yet committed
    deadline = time.monotonic() + 60
    while trainer.checkpointer.saver.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert verify(committed) is None and trainer.checkpointer.saver.pending is None


def test_ctrl_c_commits_the_checkpoint_being_written_and_says_how_to_resume(tmp_path, corpus_dir, monkeypatch, capsys):
    """Ctrl-C (KeyboardInterrupt) at step 3, while step 2's checkpoint is still being written in
    the background: that checkpoint used to be lost (never committed) behind a bare traceback. Now
    it is committed, and one line says where the run stands; exit status 130."""
    from conftest import cli_train

    from gridtrain.checkpoint.store import latest_valid_checkpoint
    from gridtrain.train.trainer import Trainer

    real = Trainer.train_step

    def interrupted_at_step_3(self):
        if self.step == 2:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", interrupted_at_step_3)
    run_dir = tmp_path / "run"
    assert cli_train(run_dir, corpus_dir, "--train.steps", "4", "--checkpoint.async_save", "true") == 130
    err = capsys.readouterr().err
    step2 = run_dir / "checkpoints" / "step-0000002"
    assert f"interrupted after step 2; the newest checkpoint is {step2}: continue with the same command and --resume" in err
    assert "Traceback" not in err
    assert latest_valid_checkpoint(run_dir / "checkpoints")[0] == step2


def test_a_lost_store_is_named_as_such_not_as_peers_behind(tmp_path, monkeypatch):
    """Node 0's agent (or rank 0) hosts the job's store: when it is killed, the survivors' error
    used to say every other rank "never reached step 24". Now, with the store answering, the rank
    behind is named; with the store gone, the lost store is."""
    import datetime

    from gridtrain.train.resilience import ProgressBoard, collective_failure

    host = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(host.port))
    board = ProgressBoard.__new__(ProgressBoard)
    board.rank, board.world_size = 1, 2
    board.store = dist.TCPStore("127.0.0.1", host.port, 1, is_master=False, timeout=datetime.timedelta(seconds=5))
    board.post(24)
    board.store.set(f"{ProgressBoard.PREFIX}0", "23")
    err = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    behind = collective_failure(err, 1, 24, 5.0, board, None, tmp_path, "at step 24")
    assert "rank 0 never reached step 24 (last started: step 23)" in str(behind)
    del host  # the store's host is gone
    lost = str(collective_failure(err, 1, 24, 5.0, board, None, tmp_path, "at step 24"))
    assert f"the job's store at 127.0.0.1:{board.store.port} no longer answers" in lost, lost
    assert "never reached" not in lost and "lost a peer in a collective at step 24" in lost
    assert json.loads((tmp_path / "failures" / "rank1.json").read_text())["ranks_last_step"] is None


def _boards_at_step_7(host, world: int) -> list:
    """`world` ranks' progress boards on `host`'s store, each having started step 7."""
    import datetime

    from gridtrain.train.resilience import ProgressBoard

    boards = []
    for rank in range(world):
        board = ProgressBoard.__new__(ProgressBoard)
        board.rank, board.world_size = rank, world
        board.store = dist.TCPStore("127.0.0.1", host.port, 1, is_master=False, timeout=datetime.timedelta(seconds=5))
        board.post(7)
        boards.append(board)
    return boards


def test_a_rank_whose_peer_dropped_the_connection_is_not_named_silent(tmp_path):
    """Rank 0 stopped inside step 7; rank 2's wait timed out first and closed its sockets, so rank
    1 saw "Connection closed by peer" and failed at once. Rank 1 answers the roll call without
    waiting for it: rank 2's roll call names rank 0 alone (it named rank 1 first, before)."""
    from gridtrain.train.resilience import collective_failure

    host = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    boards = _boards_at_step_7(host, 3)
    dropped = collective_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1234"), 1, 7, 5.0, boards[1],
                                 None, tmp_path, "at step 7")
    assert "rank 1 lost a peer in a collective at step 7" in str(dropped)
    waited = str(collective_failure(RuntimeError("Timed out waiting 5000ms for recv"), 2, 7, 5.0, boards[2], None,
                                    tmp_path, "at step 7"))
    assert "gave up on a collective at step 7 after 5 s (train.collective_timeout_s): rank 0 started step 7 but " \
           "went silent inside it" in waited, waited
    assert "rank 1" not in waited.split("Cause")[0], waited


def test_a_late_rank_is_heard_and_rank_0_keeps_the_store_until_it_has_read(tmp_path, monkeypatch):
    """Rank 3 stopped inside step 7; the others' waits time out one after another (a straggler
    enters the collective late): rank 1 1.6 s after rank 0, rank 2 1.6 s after rank 1, past the
    3 s roll call of rank 0. Rank 0 still hears rank 2 (the roll call waits 3 s after the last
    answer), names rank 3 alone, and returns (its process, the store's host, exits) only once
    ranks 1 and 2 have read the board: neither says the store no longer answers."""
    import threading

    from gridtrain.train.resilience import collective_failure

    host = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(host.port))
    boards = _boards_at_step_7(host, 4)
    said: dict[int, str] = {}

    def fail(rank: int) -> None:
        time.sleep(1.6 * rank)
        said[rank] = str(collective_failure(RuntimeError("Timed out waiting 5000ms for recv"), rank, 7, 5.0,
                                            boards[rank], None, tmp_path, "at step 7"))

    late = [threading.Thread(target=fail, args=(rank,)) for rank in (1, 2)]
    for thread in late:
        thread.start()
    fail(0)
    del host  # rank 0's process leaves, and the store with it
    for thread in late:
        thread.join()
    for rank in range(3):
        assert ": rank 3 started step 7 but went silent inside it" in said[rank], said[rank]
        assert "no longer answers" not in said[rank] and "rank 2 started" not in said[rank], said[rank]


def test_rank_0_that_lost_a_peer_keeps_the_store_until_a_roll_call_it_prolonged_has_ended(tmp_path, monkeypatch):
    """Rank 2 stopped; rank 1's wait timed out, and its roll call runs; 1.1 s later rank 0 lost
    a connection, answered (which prolongs rank 1's roll call by its 3 s) and would have left
    after 3 s of its own, taking the store while rank 1 still waited on it."""
    import threading

    from gridtrain.train.resilience import collective_failure

    host = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(host.port))
    boards = _boards_at_step_7(host, 3)
    said = []
    waiting = threading.Thread(target=lambda: said.append(str(collective_failure(
        RuntimeError("Timed out waiting 5000ms for recv"), 1, 7, 5.0, boards[1], None, tmp_path, "at step 7"))))
    waiting.start()
    time.sleep(1.1)
    lost = str(collective_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1234"), 0, 7, 5.0, boards[0],
                                  None, tmp_path, "at step 7"))
    del host  # rank 0's process leaves, and the store with it
    waiting.join()
    assert "rank 0 lost a peer in a collective at step 7" in lost, lost
    assert ": rank 2 started step 7 but went silent inside it" in said[0] and "no longer answers" not in said[0], said


def test_a_straggler_is_the_slowest_rank_in_two_windows_in_a_row(caplog):
    """Hand-made per-rank CPU seconds per step: the spread is (slowest - fastest) / median; one
    slow window is noise, two in a row by the same rank over 1.2x the median name it, a window in
    which another rank (or nobody) is slowest starts the count again."""
    from gridtrain.train.stragglers import StragglerWatch

    watch = StragglerWatch(every=10, rank=0, world_size=4)
    caplog.set_level(logging.INFO, logger="gridtrain")
    first = watch.judge(10, [0.10, 0.10, 0.20, 0.12])
    assert first["straggler/spread_pct"] == pytest.approx(100 * (0.20 - 0.10) / 0.11)
    assert (first["straggler/slowest_rank"], first["straggler/flagged_rank"]) == (2.0, -1.0)
    assert watch.judge(20, [0.10, 0.10, 0.21, 0.10])["straggler/flagged_rank"] == 2.0
    assert "straggler: rank 2 was the slowest in the last 2 windows of 10 steps, 2.10x the median" in caplog.text
    assert watch.judge(30, [0.10, 0.30, 0.10, 0.10])["straggler/flagged_rank"] == -1.0  # another rank: count anew
    assert watch.judge(40, [0.10, 0.11, 0.10, 0.10])["straggler/flagged_rank"] == -1.0  # within 1.2x: nobody
    assert watch.judge(50, [0.10, 0.30, 0.10, 0.10])["straggler/flagged_rank"] == -1.0
    assert watch.judge(60, [0.10, 0.30, 0.10, 0.10])["straggler/flagged_rank"] == 1.0


def test_the_straggler_fault_burns_the_cpu_it_says(monkeypatch):
    from gridtrain.train.resilience import slow_down

    fault = FaultConfig(at_step=3, slow_rank=1, slow_factor=3.0)
    start = time.process_time()
    slow_down(fault, 1, 2, 0.05)  # before its step
    slow_down(fault, 0, 3, 0.05)  # another rank
    assert time.process_time() - start < 0.02
    slow_down(fault, 1, 4, 0.05)
    assert time.process_time() - start >= 0.1
