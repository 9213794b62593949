"""The ranked layouts as a reader needs them: step times within TIE of each other are a tie, broken
toward the simpler layout and then the one with more memory to spare; rows that differ in one
choice and not measurably in step time are one row that shows the choice's range; and why the
first beat the second, part by part."""

from __future__ import annotations

from dataclasses import dataclass, fields

from gridtrain.plan.layout import Layout
from gridtrain.plan.memory import GiB
from gridtrain.plan.search import Candidate

TIE = 5e-3
"""Step times within 0.5% of each other are a tie: below what the model can tell apart, and about
what a run's steps vary by."""


SIMPLER = ("fewer parallel axes", "fewer virtual stages", "a lower ZeRO stage", "no recomputation",
           "fewer micro-batches")


def simplicity(layout: Layout) -> tuple:
    """Smaller is simpler: fewer parallel axes, fewer virtual stages, a lower ZeRO stage, no
    recomputation, fewer micro-batches."""
    return (sum(n > 1 for n in (layout.tp, layout.cp, layout.pp)), layout.pp_virtual_stages, layout.zero_stage,
            layout.recompute != "none", layout.num_microbatches)


def order(ranked: list[Candidate]) -> list[Candidate]:
    """Fastest first; within a run of ties (each within TIE of the fastest of its run), the
    simplest first, then the one that peaks lowest."""
    out: list[Candidate] = []
    rest = sorted(ranked, key=lambda c: c.time.total_s)
    while rest:
        lead = rest[0].time.total_s
        tied = [c for c in rest if c.time.total_s <= lead * (1 + TIE)]
        out += sorted(tied, key=lambda c: (simplicity(c.layout), c.memory.total))
        rest = rest[len(tied):]
    return out


@dataclass
class Row:
    """A ranked row: its layout, and the others that differ from it only in `field`."""

    best: Candidate
    same: list[Candidate]
    field: str | None = None

    @property
    def values(self) -> list[object]:
        return sorted({getattr(c.layout, self.field) for c in [self.best, *self.same]}) if self.field else []


def _only_difference(a: Layout, b: Layout) -> str | None:
    """The one choice two layouts differ in; the micro-batch counts as one with the number of
    micro-batches it implies, and HSDP's shard group with the replicas it implies (the batch and
    dp being the same)."""
    differ = [f.name for f in fields(Layout) if getattr(a, f.name) != getattr(b, f.name)]
    implied = {"micro_batch": "num_microbatches", "dp_shard": "dp_replicate"}
    differ = [d for d in differ if not any(d == follows and leads in differ for leads, follows in implied.items())]
    return differ[0] if len(differ) == 1 else None


def collapse(ranked: list[Candidate]) -> list[Row]:
    """One row per layout, but a layout that differs from an earlier row's in one choice (the same
    choice as that row's other variants) at a step time within TIE joins that row."""
    rows: list[Row] = []
    for cand in ranked:
        for row in rows:
            field = _only_difference(row.best.layout, cand.layout)
            if field and row.field in (None, field) and cand.time.total_s <= row.best.time.total_s * (1 + TIE):
                row.same.append(cand)
                row.field = field
                break
        else:
            rows.append(Row(cand, []))
    return rows


PART_NAMES = {"compute": "compute", "tp": "TP collectives", "cp": "CP ring", "ep": "EP all-to-alls", "pp": "pipeline sends",
              "bubble": "bubble", "dp": "exposed DP/FSDP", "optimizer": "optimizer"}


def why_first(rows: list[Row], memory_limit: float) -> list[str]:
    """Why row 1 leads row 2: the step time each part adds or saves, and the memory each leaves."""
    if len(rows) < 2:
        return []
    a, b = rows[0].best, rows[1].best
    gap = b.time.total_s - a.time.total_s
    spare = [(memory_limit - c.memory.total) / GiB for c in (a, b)]
    memory = f"#1 leaves {spare[0]:.1f} GiB of memory spare, #2 {spare[1]:.1f}"
    if gap <= a.time.total_s * TIE:
        simpler = [name for name, x, y in zip(SIMPLER, simplicity(a.layout), simplicity(b.layout)) if x != y]
        why = (f"#1 is simpler ({simpler[0]})" if simplicity(a.layout) < simplicity(b.layout) else
               "#1 leaves more memory spare" if a.memory.total < b.memory.total else "neither is simpler or leaner")
        return [f"#1 and #2 tie on step time ({a.time.total_s:.3f} s against {b.time.total_s:.3f}, within "
                f"{TIE:.1%}): {why}; {memory}"]
    parts = [(PART_NAMES[k], b.time.parts()[k] - v) for k, v in a.time.parts().items()]
    shown = [f"{name} {'+' if d > 0 else '-'}{abs(d):.3f} s" for name, d in sorted(parts, key=lambda p: -abs(p[1]))
             if abs(d) >= 1e-4 * a.time.total_s]
    return [f"#1 beats #2 by {gap:.3f} s a step ({gap / b.time.total_s:.1%}); #2 spends more (+) or less (-) on "
            f"{', '.join(shown)}; {memory}"]
