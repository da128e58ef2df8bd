"""``--plot``: GB/s per page size and strategy, next to the contiguous ceiling."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from ..extras import require
from .report import BenchRow


def plot_rows(rows: Sequence[BenchRow], path: str, title: str) -> None:
    """One panel per direction: a line per strategy, and the ceiling dashed."""
    matplotlib = require("plot")
    matplotlib.use("Agg")
    plt = require("plot", "matplotlib.pyplot")

    points: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    ceilings: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in rows:
        page = row.extra.get("page_bytes")
        direction = row.extra.get("direction")
        if (row.unit != "GB/s" or row.value is None or page is None or direction not in ("store", "load")
                or row.extra.get("load")):
            continue
        points[(direction, row.extra.get("strategy", "worker"))].append((page, row.value))
        if row.ceiling is not None:
            ceilings[direction].append((page, row.ceiling))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, direction in zip(axes, ("store", "load")):
        for (d, strategy), pts in sorted(points.items()):
            if d == direction:
                xs, ys = zip(*sorted(pts))
                ax.plot([x / 1024 for x in xs], ys, marker="o", label=strategy)
        if ceilings[direction]:
            best: dict[int, float] = {}
            for page, ceiling in ceilings[direction]:
                best[page] = max(best.get(page, 0.0), ceiling)
            xs, ys = zip(*sorted(best.items()))
            ax.plot([x / 1024 for x in xs], ys, "k--", label="contiguous copy (ceiling)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("page size (KiB)")
        ax.set_title(direction)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("GB/s")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
