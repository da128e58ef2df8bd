"""Command line: ``aiokv info`` and ``aiokv bench`` (transfer, cache, serve)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence

from . import __version__
from .bench.serve.cli import SERVE_OPTIONS, add_serve_arguments, backend_of, serve_rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aiokv", description="Awaitable KV-cache offloading: info, benchmarks.")
    p.add_argument("--version", action="version", version=f"aiokv {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backend, device, link, versions and pinnable memory")
    b = sub.add_parser("bench", help="measure transfers (default), replay a cache trace, or serve one")
    b.add_argument("what", nargs="?", choices=["transfer", "cache", "serve"], default="transfer",
                   help="transfer: GB/s beside a contiguous copy; cache: replay a request trace; "
                        "serve: time to first token on a served model, per arm")
    b.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto uses CUDA when usable, else the CPU backend")
    b.add_argument("--quick", action="store_true", help="smaller jobs and fewer repetitions")
    b.add_argument("--loop", choices=["asyncio", "trio"], default=None,
                   help="transfer, serve: event loop of the CPU bench / the server (default asyncio)")
    b.add_argument("--json", metavar="FILE",
                   help="also write the rows as JSON; '-' writes them to stdout "
                        "(the table then goes to stderr)")
    b.add_argument("--plot", metavar="FILE.png", help="draw GB/s per page size against the ceiling "
                                                      "(serve: TTFT CDFs per arm)")
    c = b.add_argument_group(
        "bench cache (and serve)", "Replays request traces through the offload cache. The traces are the "
        "Mooncake traces (kvcache-ai/Mooncake, FAST25-release/traces, Apache-2.0): JSON lines with "
        "hash_ids, found in $AIOKV_TRACE_DIR, else shared/data/mooncake beside or inside the checkout, "
        "or named with --trace.")
    c.add_argument("--trace", metavar="PATH", action="append",
                   help="cache, serve: a Mooncake-format trace file or a folder of *.jsonl traces "
                        "(repeatable)")
    c.add_argument("--capacity", metavar="BLOCKS", type=int, action="append",
                   help="cache: host capacity in blocks (repeatable; default 2000, 8000, 32000)")
    c.add_argument("--policy", default=None,
                   help="cache, serve: policy name (default: the recommended one)")
    c.add_argument("--tiers", metavar="SPEC",
                   help="cache: tiers under the host, e.g. host=2000,disk=32000[,redis=8000] (blocks): "
                        "replays the trace through the real cache over a temporary disk tier (and "
                        "Redis), with the hit rate per tier, and each tier's restore GB/s beside its "
                        "ceiling")
    c.add_argument("--redis-url", metavar="URL",
                   help="cache --tiers with redis=N, serve (adds the redis arm): the Redis/Valkey "
                        "server (the bench deletes what it wrote)")
    c.add_argument("--tier-dir", metavar="DIR",
                   help="cache --tiers, serve: the folder the disk tier writes under (default: the "
                        "system's temporary folder)")
    add_serve_arguments(b)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "info":
        from .info import print_info

        print_info()
        return 0
    return _bench(args)


# Options only some kinds of run read: given to another kind they would be ignored
# silently, and a user would read figures that are not what they asked for.
_READ_BY: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("--trace", "trace", ("cache", "serve")), ("--capacity", "capacity", ("cache",)),
    ("--policy", "policy", ("cache", "serve")), ("--loop", "loop", ("transfer", "serve")),
    ("--plot", "plot", ("transfer", "serve")), ("--tiers", "tiers", ("cache",)),
    ("--redis-url", "redis_url", ("cache", "serve")), ("--tier-dir", "tier_dir", ("cache", "serve")),
    *((flag, attr, ("serve",)) for flag, attr in SERVE_OPTIONS),
)


def _misplaced_option(args: argparse.Namespace) -> str | None:
    """The first option given that this kind of run would ignore, as a usage message."""
    for flag, attr, kinds in _READ_BY:
        if args.what not in kinds and getattr(args, attr) is not None:
            which = " and ".join(f"`aiokv bench {k}`" for k in kinds)
            return f"aiokv bench {args.what}: {flag} is an option of {which}; drop it or run that"
    if args.what == "cache" and not args.tiers:
        for flag, attr in (("--redis-url", "redis_url"), ("--tier-dir", "tier_dir")):
            if getattr(args, attr) is not None:
                return f"aiokv bench cache: {flag} is an option of --tiers; add --tiers host=N,disk=M,..."
    if args.what == "cache" and args.tiers and args.capacity is not None:
        return "aiokv bench cache: --capacity is not read with --tiers (host=N sets the host's capacity)"
    return None


def _bench(args: argparse.Namespace) -> int:
    from .backends import cuda_usable
    from .bench import bench_meta, format_table, progress_printer, run_bench, write_json

    say = progress_printer()
    if (message := _misplaced_option(args)) is not None:
        print(message, file=sys.stderr)
        return 2
    json_to_stdout = args.json == "-"
    for flag, path in (("--json", None if json_to_stdout else args.json), ("--plot", args.plot)):
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
    loop = args.loop or "asyncio"
    if args.what != "cache" and loop != "asyncio" and importlib.util.find_spec(loop) is None:
        print(f"aiokv bench: --loop {loop} needs {loop} installed", file=sys.stderr)
        return 2
    if args.plot:
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
    if args.plot and args.what == "serve":
        from .bench.serve.report import plot_cdfs

        plot_cdfs(rows, args.plot, title=f"aiokv bench serve: TTFT per arm ({meta['backend']})")
        say(f"wrote {os.path.abspath(args.plot)}")
    elif args.plot:
        from .bench.plot import plot_rows

        plot_rows(rows, args.plot, title=f"aiokv bench ({meta['backend']})")
        say(f"wrote {os.path.abspath(args.plot)}")
    failed = [f"{r.section} / {r.name}" for r in rows if r.failed]
    if failed:  # a script or CI must not read a failed check as a pass
        print(f"aiokv bench: {len(failed)} figure(s) failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
