"""How the test suite shares this machine's cores between pytest-xdist workers (`pytest -n 2`,
the README's test command).

Most of the suite's time is multi-process launches that keep one to two cores busy, and
single-process tests that keep one: run one after another on 2 cores, a quarter of the machine
idled. Two workers fill it. Three rules keep that sound:

- **Groups.** A worker takes a whole group at a time (`GroupScheduling`): the tests that read the
  shared launches (tests/launches.py) are one group, so that one worker launches each world size
  once; the `alone` tests are another; every other test is in its module's group, so that a
  module-scoped fixture is built once.
- **Alone.** A test marked `alone` holds wall-clock time to a bound (a collective timeout of 5 s
  that must catch a stalled rank and no healthy one, heartbeats every second, a GET under a
  second) or loads every core itself: another worker's launch of 16 processes would make it fail
  for no fault of the code. While the `alone` group runs, the other worker runs no `dist` test
  (one that starts processes), only single-process ones: a readers-writer lock on a file, which
  every `dist` test holds shared and the `alone` group exclusive, with a turnstile that keeps the
  group from starving.
- **Order.** The `alone` group is queued first and the single-process groups next, so that the
  other worker has them to run meanwhile; then the two longest groups, so that neither is the
  last thing running; then the other `dist` groups as collected.

Without xdist (plain `pytest`) none of this applies: the tests run one after another as
collected.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ALONE = "alone"
LONGEST = ("launches", "test_parity")


def run_folder(run_id: str) -> Path:
    """Where a test run's workers and its controller meet: the groups and the lock files."""
    return Path(tempfile.gettempdir()) / f"gridtrain-tests-{run_id}"


def group_of(item: pytest.Item) -> str:
    if item.get_closest_marker(ALONE):
        return ALONE
    if "launches" in item.fixturenames:
        return "launches"
    return item.module.__name__


def starts_processes(item: pytest.Item) -> bool:
    """A `dist` test, one reading the shared launches, or one driving Chromium (its processes)."""
    return item.get_closest_marker("dist") is not None or not {"launches", "browser"}.isdisjoint(item.fixturenames)


def assign_groups(items: list[pytest.Item], folder: Path) -> None:
    """Queue the items in the order of the module docstring (a stable sort: within a rank, the
    collection's order, which every worker shares), and write each one's group for the
    controller's `GroupScheduling` (every worker writes the same)."""
    groups = {item: group_of(item) for item in items}
    assert not any(groups[item] == ALONE and "launches" in item.fixturenames for item in items), \
        "an `alone` test reads the shared launches: its worker would launch them a second time"
    with_processes = {groups[item] for item in items if starts_processes(item)}

    def rank(item: pytest.Item) -> int:
        group = groups[item]
        if group == ALONE:
            return 0
        if group not in with_processes:
            return 1
        return 2 + LONGEST.index(group) if group in LONGEST else 2 + len(LONGEST)

    items.sort(key=rank)
    written = folder / f"groups.{os.getpid()}.json"
    written.write_text(json.dumps({item.nodeid: groups[item] for item in items}))
    os.replace(written, folder / "groups.json")


def make_scheduler(config: pytest.Config, log: object, folder: Path) -> object:
    """xdist's scheduling by scope (a worker takes a whole scope, the scopes queued in collection
    order), with each test's group as its scope. (xdist's own `--dist loadgroup` reads a group
    from a node id that pytest 9 no longer lets it change, and changing it ourselves leaks
    "@GROUP" into every reported id.)"""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once every worker has collected (and written them)
                self.groups = json.loads((folder / "groups.json").read_text())
            return self.groups.get(nodeid, nodeid.rsplit("::", 1)[0])  # else its module's, as xdist's

    config.option.loadscopereorder = False  # keep assign_groups' order, not the largest first
    return GroupScheduling(config, log)


class Turns:
    """The readers-writer lock between a test run's workers: `shared` for every `dist` test,
    `alone` held from the first `alone` test to the last. An flock is released when the process
    holding it dies, so a crashed worker blocks no other."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
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
