"""Benchmark rows and how they print: every figure beside its ceiling from the same run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

__all__ = ["BenchRow", "format_table", "write_json"]


@dataclass
class BenchRow:
    """One measured figure.

    ``value`` is in ``unit``; when ``ceiling`` is set (same unit, measured in the same run,
    e.g. a contiguous pinned copy of the same bytes) the table shows ``value / ceiling``.
    """

    section: str
    name: str
    value: float
    unit: str
    ceiling: float | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # The figure could not be measured, or what it moved was wrong: the command exits 1.
    failed: bool = False

    @property
    def ratio(self) -> float | None:
        if self.ceiling is None or self.ceiling == 0:
            return None
        return self.value / self.ceiling


def format_table(rows: Sequence[BenchRow]) -> str:
    """A plain-text table, grouped by section."""
    lines: list[str] = []
    header = f"{'figure':<46} {'value':>12} {'ceiling':>12} {'ratio':>7}  note"
    section = None
    order = {name: i for i, name in enumerate(dict.fromkeys(r.section for r in rows))}
    for row in sorted(rows, key=lambda r: order[r.section]):
        if row.section != section:
            section = row.section
            lines += ["", f"== {section} ==", header, "-" * len(header)]
        value = f"{row.value:,.2f} {row.unit}"
        ceiling = f"{row.ceiling:,.2f}" if row.ceiling is not None else ""
        ratio = f"{row.ratio:.2f}" if row.ratio is not None else ""
        lines.append(f"{row.name:<46} {value:>12} {ceiling:>12} {ratio:>7}  {row.note}")
    return "\n".join(lines).lstrip("\n")


def write_json(target: str | TextIO, rows: Sequence[BenchRow], meta: dict[str, Any]) -> None:
    """Write ``{"meta": ..., "rows": [...]}`` to a file path or an open text stream."""
    payload = {"meta": meta, "rows": [{**asdict(r), "ratio": r.ratio} for r in rows]}
    if not isinstance(target, str):
        json.dump(payload, target, indent=2)
        target.write("\n")
        target.flush()
        return
    with open(target, "w") as fh:
        json.dump(payload, fh, indent=2)
