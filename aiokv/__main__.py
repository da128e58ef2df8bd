"""Command line: ``aiokv info`` and ``aiokv bench`` (transfer, cache, serve)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from . import __version__
from .bench.serve.cli import add_serve_arguments, backend_of, serve_rows
from .bench.trace import FULL_TRACES

KINDS = ("transfer", "cache", "serve")
"""The kinds of ``aiokv bench``; without one, ``transfer`` runs."""


class _HelpFormatter(argparse.HelpFormatter):
    """Shows an option's default where it has one (None means "chosen", which the help says)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (action.option_strings and default not in (None, False, argparse.SUPPRESS)
                and "default" not in text):
            text += " (default: %(default)s)"
        return text

    def _split_lines(self, text: str, width: int) -> list[str]:
        # Never inside a URL or a flag: a wrapped address cannot be copied.
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


def _kind(kinds: Any, name: str, summary: str, description: str, quick: str) -> argparse.ArgumentParser:
    """One kind of bench run, with the options every kind reads."""
    k: argparse.ArgumentParser = kinds.add_parser(name, help=summary, description=description,
                                                  formatter_class=_HelpFormatter)
    k.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto uses CUDA when usable, else the CPU backend")
    k.add_argument("--quick", action="store_true", help=quick)
    k.add_argument("--json", metavar="FILE",
                   help="also write the rows and a meta block as JSON; '-' writes them to stdout "
                        "(the table then goes to stderr)")
    return k


def _trace_options(k: argparse.ArgumentParser, *, serve: bool) -> None:
    where = ("default: conversation_trace.jsonl found as `aiokv bench cache` finds traces, else the "
             "slice of it shipped with aiokv (its first 400 requests, enough for --quick)") if serve else (
             "default: the *.jsonl files of $AIOKV_TRACE_DIR, else of shared/data/mooncake beside or "
             "inside the checkout, or of data/mooncake")
    k.add_argument("--trace", metavar="PATH", action="append",
                   help=f"a Mooncake-format trace file or a folder of *.jsonl traces (repeatable); {where}. "
                        f"The full Mooncake traces (Apache-2.0): {FULL_TRACES}")
    k.add_argument("--policy", default=None, help="OffloadCache policy name (default: the recommended one)")
    k.add_argument("--tier-dir", metavar="DIR",
                   help=("with --tiers: " if not serve else "")
                   + "the folder the disk tier writes under (default: the system's temporary folder)")


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    p = argparse.ArgumentParser(prog="aiokv", description="Awaitable KV-cache offloading: info, benchmarks.")
    p.add_argument("--version", action="version", version=f"aiokv {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backend, device, link, versions and pinnable memory")
    b = sub.add_parser("bench", help="measure transfers (default), replay a cache trace, or serve one",
                       description="Benchmarks. `aiokv bench` alone runs `aiokv bench transfer`; "
                                   "`aiokv bench KIND --help` lists that kind's options and defaults.")
    kinds = b.add_subparsers(dest="what", required=True, metavar="KIND")
    t = _kind(kinds, "transfer", "GB/s beside a contiguous copy (the default)",
              "Store and load GB/s of KV-shaped jobs through the public worker beside a contiguous "
              "copy of the same bytes, host submit time and completion wake-up (docs/cli.md).",
              "smaller jobs and fewer repetitions (seconds on the CPU backend)")
    t.add_argument("--loop", choices=["asyncio", "trio"], default=None,
                   help="event loop of the CPU transfer bench (default asyncio)")
    t.add_argument("--plot", metavar="FILE.png", help="draw GB/s per page size against the ceiling")
    c = _kind(kinds, "cache", "replay request traces through the offload cache",
              "Hit rates per trace and capacity beside LRU and the offline optimum, and restores "
              "through a real OffloadCache (docs/cli.md, docs/tiers.md).",
              "the first 3000 requests of each trace, fewer through the real cache")
    _trace_options(c, serve=False)
    c.add_argument("--capacity", metavar="BLOCKS", type=int, action="append",
                   help="host capacity in blocks (repeatable; default 2000, 8000, 32000)")
    c.add_argument("--tiers", metavar="SPEC",
                   help="tiers under the host, e.g. host=2000,disk=32000[,redis=8000] (blocks): "
                        "replays the trace through the real cache over a temporary disk tier (and "
                        "Redis), with the hit rate per tier, and each tier's restore GB/s beside its "
                        "ceiling")
    c.add_argument("--redis-url", metavar="URL",
                   help="with --tiers ...,redis=N: the Redis/Valkey server (the bench deletes what it wrote)")
    s = _kind(kinds, "serve", "time to first token on a served model, per arm",
              "Time to first token of requests served by an async server over OffloadCache, per arm, "
              "each beside its lower bound (docs/serve.md). Where a default differs, the help gives "
              "both: on CUDA, and on the CPU backend (where --quick runs).",
              "the CPU backend (unless --backend cuda), the tiny model and the sizes of a CPU run; "
              "runs from a fresh clone on the trace slice shipped with aiokv")
    s.add_argument("--loop", choices=["asyncio", "trio"], default=None,
                   help="event loop of the server (default asyncio)")
    s.add_argument("--plot", metavar="FILE.png",
                   help="draw each arm's TTFT CDF and one layerwise load's layers (needs matplotlib)")
    _trace_options(s, serve=True)
    add_serve_arguments(s)
    return p, {"transfer": t, "cache": c, "serve": s}


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["bench"] and (len(given) == 1 or given[1] not in (*KINDS, "-h", "--help")):
        given.insert(1, "transfer")
    parser, kinds = _parser()
    if given[:1] == ["bench"] and given[1] in kinds:
        if (message := _misplaced_option(given[1], given[2:], kinds)) is not None:
            print(message, file=sys.stderr)
            return 2
    args = parser.parse_args(given)
    if args.command == "info":
        from .info import print_info

        print_info()
        return 0
    return _bench(args)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _misplaced_option(kind: str, argv: Sequence[str],
                      kinds: dict[str, argparse.ArgumentParser]) -> str | None:
    """The first option given that only another kind of run reads, as a usage message
    (argparse alone would only call it unrecognised)."""
    own = _flags(kinds[kind])
    for token in argv:
        flag = token.split("=", 1)[0]
        if not flag.startswith("--") or flag in own:
            continue
        others = [k for k, p in kinds.items() if flag in _flags(p)]
        if others:
            which = " and ".join(f"`aiokv bench {k}`" for k in others)
            return f"aiokv bench {kind}: {flag} is an option of {which}; drop it or run that"
    return None


def _cache_usage(args: argparse.Namespace) -> str | None:
    """Options of ``bench cache`` that only go together."""
    if args.what != "cache":
        return None
    if not args.tiers:
        for flag, attr in (("--redis-url", "redis_url"), ("--tier-dir", "tier_dir")):
            if getattr(args, attr) is not None:
                return f"aiokv bench cache: {flag} is an option of --tiers; add --tiers host=N,disk=M,..."
    if args.tiers and args.capacity is not None:
        return "aiokv bench cache: --capacity is not read with --tiers (host=N sets the host's capacity)"
    return None


def _bench(args: argparse.Namespace) -> int:
    from .backends import cuda_usable
    from .bench import bench_meta, format_table, progress_printer, run_bench, write_json

    say = progress_printer()
    if (message := _cache_usage(args)) is not None:
        print(message, file=sys.stderr)
        return 2
    plot, loop = getattr(args, "plot", None), getattr(args, "loop", None) or "asyncio"
    json_to_stdout = args.json == "-"
    for flag, path in (("--json", None if json_to_stdout else args.json), ("--plot", plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            print(f"aiokv bench: {flag} {path}: {folder} is not a folder this user can write to",
                  file=sys.stderr)
            return 2
        if path and os.path.isdir(path):  # found before the run, not after minutes of it
            print(f"aiokv bench: {flag} {path} is a folder; give a file name", file=sys.stderr)
            return 2
    if args.backend == "cuda" and not cuda_usable():
        print("aiokv bench: --backend cuda needs a usable CUDA device and cuda-python", file=sys.stderr)
        return 2
    if args.what != "cache" and loop != "asyncio" and importlib.util.find_spec(loop) is None:
        print(f"aiokv bench: --loop {loop} needs {loop} installed", file=sys.stderr)
        return 2
    if plot:
        from .errors import MissingExtra
        from .extras import require

        try:
            require("plot")
        except MissingExtra as exc:
            print(f"aiokv bench: {exc}", file=sys.stderr)
            return 2
    if args.what == "serve":
        try:
            rows, serve_meta = serve_rows(args, backend_of(args, cuda_usable), say)
        except (FileNotFoundError, ValueError) as exc:
            print(f"aiokv bench serve: {exc}", file=sys.stderr)
            return 2
        meta = {**bench_meta(backend_of(args, cuda_usable)), **serve_meta}
    elif args.what == "cache" and args.tiers:
        from .bench.cache import find_traces
        from .bench.tiers import parse_tiers, run_tier_bench

        try:
            rows = run_tier_bench(find_traces(args.trace), parse_tiers(args.tiers), policy=args.policy,
                                  redis_url=args.redis_url, quick=args.quick, tier_dir=args.tier_dir,
                                  progress=say)
        except (FileNotFoundError, ValueError) as exc:
            print(f"aiokv bench cache: {exc}", file=sys.stderr)
            return 2
        meta = bench_meta("cpu")
    elif args.what == "cache":
        from .bench.cache import run_cache_bench

        try:
            rows = run_cache_bench(traces=args.trace, capacities=args.capacity, policy=args.policy,
                                   quick=args.quick, progress=say)
        except (FileNotFoundError, ValueError) as exc:
            print(f"aiokv bench cache: {exc}", file=sys.stderr)
            return 2
        meta = bench_meta("cuda" if cuda_usable() else "cpu")
    else:
        backend = args.backend
        if backend == "auto":
            backend = "cuda" if cuda_usable() else "cpu"
        say(f"transfer benchmark on the {backend} backend{' (quick)' if args.quick else ''}")
        rows = run_bench(backend, quick=args.quick, loop=loop, progress=say)
        meta = bench_meta(backend)
    # With --json - stdout carries the JSON alone, so a pipe into a JSON reader works.
    print(format_table(rows), file=sys.stderr if json_to_stdout else sys.stdout)
    if json_to_stdout:
        write_json(sys.stdout, rows, meta)
    elif args.json:
        write_json(args.json, rows, meta)
        say(f"wrote {os.path.abspath(args.json)}")
    if plot and args.what == "serve":
        from .bench.serve.report import plot_cdfs

        plot_cdfs(rows, plot, title=f"aiokv bench serve: TTFT per arm ({meta['backend']})")
        say(f"wrote {os.path.abspath(plot)}")
    elif plot:
        from .bench.plot import plot_rows

        plot_rows(rows, plot, title=f"aiokv bench ({meta['backend']})")
        say(f"wrote {os.path.abspath(plot)}")
    failed = [f"{r.section} / {r.name}" for r in rows if r.failed]
    if failed:  # a script or CI must not read a failed check as a pass
        print(f"aiokv bench: {len(failed)} figure(s) failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
