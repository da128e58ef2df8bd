"""Benchmark rows and how they print: every figure beside its ceiling from the same run."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

__all__ = ["COUNT_UNITS", "BenchRow", "format_table", "write_json"]


COUNT_UNITS = frozenset({"blocks", "loads", "tokens", "requests", "keys", "jobs", "layers", "calls",
                         "chunks", "polls"})
"""Units of things counted: a whole number of them prints without decimals."""


@dataclass
class BenchRow:
    """One measured figure.

    ``value`` is in ``unit``, or None when the figure was not measured here (a skipped row:
    the table says "skipped", the JSON null, never a 0 that reads as a measurement). When
    ``ceiling`` is set (same unit, measured in the same run, e.g. a contiguous pinned copy
    of the same bytes) the table shows ``value / ceiling``; with ``bound`` it is a lower
    bound instead (a time the figure cannot beat), and the table says so. ``target`` is a
    goal the value is held to, as (``"<="`` or ``">="``, number): the table marks it met or
    MISSED (a miss is a finding, not a failure: ``failed`` is for figures that are wrong).
    """

    section: str
    name: str
    value: float | None
    unit: str
    ceiling: float | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # The figure could not be measured, or what it moved was wrong: the command exits 1.
    failed: bool = False
    bound: bool = False
    target: tuple[str, float] | None = None

    @classmethod
    def skipped(cls, section: str, name: str, why: str) -> BenchRow:
        """A figure this run does not measure, and why."""
        return cls(section, name, None, "", note=why)

    @property
    def ratio(self) -> float | None:
        if self.value is None or self.ceiling is None or self.ceiling == 0:
            return None
        return self.value / self.ceiling

    @property
    def target_met(self) -> bool | None:
        """Whether the value meets ``target`` (None: no target, or no value to judge)."""
        if self.target is None or self.value is None or math.isnan(self.value):
            return None
        op, goal = self.target
        return self.value <= goal if op == "<=" else self.value >= goal


def _number(value: float, unit: str) -> str:
    if unit in COUNT_UNITS and float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.2f}"


def _reference(row: BenchRow, marked: bool) -> str:
    if row.ceiling is None:
        return ""
    number = _number(row.ceiling, row.unit)
    if not marked:
        return number
    return f">= {number}" if row.bound else f"<= {number}"


def _target(row: BenchRow) -> str:
    if row.target is None:
        return ""
    op, goal = row.target
    met = row.target_met
    return f"{op} {goal:g} " + ("n/a" if met is None else "met" if met else "MISSED")


def format_table(rows: Sequence[BenchRow]) -> str:
    """A plain-text table, grouped by section. The reference column is headed "ceiling"; in a
    section with lower bounds it is "ceiling/bound" and each entry says which (``<=`` a
    ceiling the value stays under, ``>=`` a bound it stays above). Sections with targets get
    a column marking each met or MISSED."""
    lines: list[str] = []
    order = {name: i for i, name in enumerate(dict.fromkeys(r.section for r in rows))}
    by_section: dict[str, list[BenchRow]] = {}
    for row in sorted(rows, key=lambda r: order[r.section]):
        by_section.setdefault(row.section, []).append(row)
    for section, group in by_section.items():
        bounds = any(r.bound and r.ceiling is not None for r in group)
        targets = any(r.target is not None for r in group)
        reference = "ceiling/bound" if bounds else "ceiling"
        header = f"{'figure':<46} {'value':>15} {reference:>13} {'ratio':>7}  "
        header += f"{'target':<16} note" if targets else "note"
        lines += ["", f"== {section} ==", header, "-" * len(header)]
        for row in group:
            value = (("FAILED" if row.failed else "skipped") if row.value is None
                     else f"{_number(row.value, row.unit)} {row.unit}".rstrip())
            ratio = f"{row.ratio:.2f}" if row.ratio is not None else ""
            mark = f"{_target(row):<16} " if targets else ""
            lines.append(f"{row.name:<46} {value:>15} {_reference(row, bounds):>13} {ratio:>7}  "
                         f"{mark}{row.note}".rstrip())
    return "\n".join(lines).lstrip("\n")


def write_json(target: str | TextIO, rows: Sequence[BenchRow], meta: dict[str, Any]) -> None:
    """Write ``{"meta": ..., "rows": [...]}`` to a file path or an open text stream. A
    skipped row's ``value`` is null; a row with a target has ``target`` ``[op, goal]`` and
    ``target_met``."""
    payload = {"meta": meta, "rows": [{**asdict(r), "ratio": r.ratio, "target_met": r.target_met}
                                      for r in rows]}
    if not isinstance(target, str):
        json.dump(payload, target, indent=2)
        target.write("\n")
        target.flush()
        return
    with open(target, "w") as fh:
        json.dump(payload, fh, indent=2)
