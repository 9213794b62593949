"""When a layout search stops before it has tried everything: a time budget and a cancellation
check, set by whoever awaits the answer (the explorer, one per request; the command line sets none
and searches to the end).

A search asks `check_stop()` between cores: it raises SearchCancelled once nobody awaits the answer
(the page typed on and dropped the request), and SearchTimeout past the hard deadline. Once it has
found a layout, it asks `out_of_time()` instead: past the soft deadline it stops and returns the best
found so far, and the budget records that the answer is partial (never a refusal of valid inputs).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

CANCEL_POLL_S = 0.02
"""How often, at most, a search asks whether its client is still there (the question costs a
system call)."""


class SearchCancelled(Exception):
    """Nobody awaits this search's answer any more."""


class SearchTimeout(Exception):
    """The search passed its hard deadline without finding one layout that fits."""


@dataclass
class SearchBudget:
    """One answer's time and interest: soft and hard deadlines on time.monotonic(), and a callable
    that says True once nobody awaits the answer."""

    soft_deadline: float
    """Past it a search that has found a layout returns its best so far."""
    hard_deadline: float
    """Past it a search that has found nothing gives up (SearchTimeout)."""
    cancelled: Callable[[], bool] = lambda: False
    partial: bool = False
    """Set once a search of this answer stopped early: its ranking is the best found, not the best."""
    _next_poll: float = field(default=0.0, repr=False)

    def check(self) -> None:
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + CANCEL_POLL_S
            if self.cancelled():
                raise SearchCancelled("nobody awaits this search")
        if now > self.hard_deadline:
            raise SearchTimeout(
                f"the search ran out of its time ({self.hard_deadline - self.soft_deadline:.3g} s past its "
                "budget) before any layout fitted: fix more of the layout (tp, pp, cp, ZeRO) so fewer layouts "
                "are left to try, or ask `gridtrain plan`, which has no time limit")


BUDGET: contextvars.ContextVar[SearchBudget | None] = contextvars.ContextVar("search_budget", default=None)


@contextlib.contextmanager
def budget(seconds: float, hard_seconds: float,
           cancelled: Callable[[], bool] = lambda: False) -> Iterator[SearchBudget]:
    """The searches inside run under this budget (seconds soft, hard_seconds hard, from now)."""
    now = time.monotonic()
    b = SearchBudget(now + seconds, now + max(seconds, hard_seconds), cancelled)
    token = BUDGET.set(b)
    try:
        yield b
    finally:
        BUDGET.reset(token)


def check_stop() -> None:
    """SearchCancelled or SearchTimeout when the budget says so; nothing without a budget."""
    b = BUDGET.get()
    if b is not None:
        b.check()


def out_of_time() -> bool:
    """True past the soft deadline (and the answer is then marked partial); False without a budget."""
    b = BUDGET.get()
    if b is None or time.monotonic() <= b.soft_deadline:
        return False
    b.partial = True
    return True
