"""The roll call after a finished run (train/distributed.py): rank 0's process may host the job's
store (`gridtrain train --nproc` runs without torchrun's agent store), so no peer may still be
polling it when rank 0 leaves, and a store gone before the count is complete ends the wait instead
of failing the finished run. One process: a TCPStore server as rank 0's, a client as rank 1's."""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

from gridtrain.train import distributed


class Recording:
    """A store whose failed calls are kept, to see whether a rank met a dead store."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.errors = store, []

    def add(self, key: str, value: int) -> int:
        try:
            return self.store.add(key, value)
        except dist.DistError as err:
            self.errors.append(err)
            raise


def _stores(world: int) -> tuple[dist.TCPStore, dist.TCPStore]:
    timeout = datetime.timedelta(seconds=10)
    server = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
    return server, dist.TCPStore("127.0.0.1", server.port, world, is_master=False, timeout=timeout)


def _answer_in_thread(store: Recording, rank: int, world: int) -> tuple[threading.Thread, list[str]]:
    done: list[str] = []

    def run() -> None:
        distributed.answer_roll_call(store, rank, world, "k", timeout_s=10.0)
        done.append("returned")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


def test_rank0_hosting_the_store_leaves_after_every_peer(monkeypatch) -> None:
    sleep = time.sleep
    monkeypatch.setattr(distributed.time, "sleep", lambda s: sleep(0.2))  # a peer slow to poll (2 cores, 4 ranks)
    server, client = _stores(2)
    peer = Recording(client)
    thread, done = _answer_in_thread(peer, 1, 2)
    while server.add("k", 0) < 1:
        sleep(0.01)
    distributed.answer_roll_call(server, 0, 2, "k", timeout_s=10.0)
    del server  # rank 0's process exits, and its store with it
    thread.join(10)
    assert done == ["returned"] and peer.errors == []


def test_store_gone_before_the_count_ends_the_wait() -> None:
    server, client = _stores(3)
    thread, done = _answer_in_thread(Recording(client), 1, 3)
    while server.add("k", 0) < 1:
        time.sleep(0.01)
    del server  # rank 0 left at its deadline (rank 2 never came)
    thread.join(5)
    assert done == ["returned"]
