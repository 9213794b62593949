"""How the test suite shares this machine's cores between pytest-xdist workers (`pytest -n 2`,
the README's test command).

Most of the suite's time is multi-process launches that keep one to two cores busy, and
single-process tests that keep one: run one after another on 2 cores, a quarter of the machine
idled. Two workers fill it. Three rules keep that sound:

- **Groups.** Every test runs in an xdist group (`--dist loadgroup`, pyproject.toml): the tests
  that read the shared launches (tests/launches.py) in one, so that one worker launches each
  world size once, and every other test in its module's, so that a module-scoped fixture is built
  once.
- **Alone.** A test marked `alone` holds wall-clock time to a bound (a collective timeout of 5 s
  that must catch a stalled rank and no healthy one, heartbeats every second, a GET under a
  second): another worker's launch of 16 processes would make it fail for no fault of the code.
  While the `alone` group runs, the other worker runs no `dist` test (one that starts
  processes), only single-process ones: a readers-writer lock on a file, which every `dist` test
  holds shared and the `alone` group exclusive, with a turnstile that keeps the group from
  starving.
- **Order.** The `alone` group is queued first and the single-process groups next, so that the
  other worker has them to run meanwhile; then the two longest groups, so that neither is the
  last thing running; then the other `dist` groups as collected (`--no-loadscope-reorder`).

Without xdist (plain `pytest`) none of this applies: the tests run one after another as
collected.
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _pytest.nodeid import NodeId

ALONE = "alone"
LONGEST = ("launches", "test_parity")


def group_of(item: pytest.Item) -> str:
    if item.get_closest_marker(ALONE):
        return ALONE
    if "launches" in item.fixturenames:
        return "launches"
    return item.module.__name__


def starts_processes(item: pytest.Item) -> bool:
    return item.get_closest_marker("dist") is not None or "launches" in item.fixturenames


def assign_groups(items: list[pytest.Item]) -> None:
    """Put each item in its xdist group and queue the groups in the module docstring's order (a
    stable sort: within a rank, the collection's order, which every worker shares).

    `--dist loadgroup` reads an item's group from its node id, "NODEID@GROUP". xdist 3.8 writes
    that id to `item._nodeid` (from the `xdist_group` mark), where pytest 9 no longer reads it
    (node ids are `NodeId`s in `item._id`), so the groups were silently ignored and each test
    went to whichever worker was free: written here where pytest 9 reads it."""
    groups = {item: group_of(item) for item in items}
    with_processes = {groups[item] for item in items if starts_processes(item)}

    def rank(item: pytest.Item) -> int:
        group = groups[item]
        if group == ALONE:
            return 0
        if group not in with_processes:
            return 1
        return 2 + LONGEST.index(group) if group in LONGEST else 2 + len(LONGEST)

    items.sort(key=rank)
    for item in items:
        item._id = NodeId.parse(f"{item.nodeid}@{groups[item]}")


class Turns:
    """The readers-writer lock between a test run's workers: `shared` for every `dist` test,
    `alone` held from the first `alone` test to the last. fcntl locks are released when the process
    holding them dies, so a crashed worker blocks no other."""

    def __init__(self, run_id: str) -> None:
        self.folder = Path(tempfile.gettempdir()) / f"gridtrain-tests-{run_id}"
        self.folder.mkdir(exist_ok=True)
        self._alone: contextlib.ExitStack | None = None

    @contextlib.contextmanager
    def _hold(self, name: str, mode: int) -> Iterator[None]:
        with open(self.folder / name, "a") as f:
            fcntl.flock(f, mode)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._hold("turnstile", fcntl.LOCK_EX):
            pass  # waits while an `alone` group holds it
        with self._hold("run", fcntl.LOCK_SH):
            yield

    def enter_alone(self) -> None:
        if self._alone is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self._hold("turnstile", fcntl.LOCK_EX))
            stack.enter_context(self._hold("run", fcntl.LOCK_EX))
            self._alone = stack

    def leave_alone(self) -> None:
        if self._alone is not None:
            self._alone.close()
            self._alone = None
