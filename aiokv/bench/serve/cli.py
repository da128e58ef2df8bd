"""The options of ``aiokv bench serve`` and the run they ask for (argparse only; the model
and the server load when the run starts)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..report import BenchRow

__all__ = ["SERVE_OPTIONS", "add_serve_arguments", "serve_rows"]

SERVE_OPTIONS = (
    ("--mode", "serve_mode"), ("--model", "serve_model"), ("--layers", "layers"),
    ("--requests", "requests"), ("--warmup", "warmup"), ("--block-tokens", "block_tokens"),
    ("--max-tokens", "max_tokens"), ("--prefixes", "prefixes"), ("--prefix-tokens", "prefix_tokens"),
    ("--suffix-tokens", "suffix_tokens"), ("--compress", "compress"), ("--load", "load"),
    ("--gpu-blocks", "gpu_blocks"), ("--host-blocks", "host_blocks"), ("--disk-blocks", "disk_blocks"),
    ("--redis-blocks", "redis_blocks"), ("--redis-server", "redis_server"),
    ("--arms", "arms"), ("--segments", "segments"), ("--decode-tokens", "decode_tokens"), ("--seed", "seed"),
)
"""(flag, attribute) of every option only ``aiokv bench serve`` reads."""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("serve", "options of `aiokv bench serve` (see docs/serve.md)")
    g.add_argument("--mode", dest="serve_mode", choices=["trace", "prefix", "correctness"],
                   help="serve: replay the trace (default), prefix repetition, or only the "
                        "greedy-decode correctness check")
    g.add_argument("--model", dest="serve_model", choices=["llama3-8b", "tiny"],
                   help="serve: model shape (default llama3-8b on CUDA, tiny on the CPU and with --quick)")
    g.add_argument("--layers", type=int, help="serve: decoder layers (default 32 for llama3-8b, 2 for tiny)")
    g.add_argument("--requests", type=int, help="serve: measured requests")
    g.add_argument("--warmup", type=int, help="serve: requests before them that only warm the caches")
    g.add_argument("--block-tokens", type=int,
                   help="serve: tokens per 512-token trace block (scales prompts)")
    g.add_argument("--max-tokens", type=int, help="serve: longest prompt (longer ones are cut)")
    g.add_argument("--prefixes", type=int, help="serve --mode prefix: shared prefixes (default 4)")
    g.add_argument("--prefix-tokens", type=int, help="serve --mode prefix: tokens of each prefix")
    g.add_argument("--suffix-tokens", type=int, help="serve --mode prefix: tokens after the prefix")
    g.add_argument("--compress", type=float, metavar="F",
                   help="serve: divide trace timestamps by F (default: chosen for --load)")
    g.add_argument("--load", type=float,
                   help="serve: offered load of the recompute arm that picks the compression "
                        "(default 0.5 on CUDA, 0.3 on the CPU)")
    g.add_argument("--gpu-blocks", type=int, help="serve: GPU KV pool in 16-token blocks")
    g.add_argument("--host-blocks", type=int, help="serve: host tier (OffloadCache) in blocks")
    g.add_argument("--disk-blocks", type=int, help="serve: disk tier in blocks")
    g.add_argument("--redis-blocks", type=int,
                   help="serve: Redis tier in blocks (default: the disk tier's, at most an eighth of RAM)")
    g.add_argument("--redis-server", metavar="PATH",
                   help="serve: a redis-server binary the bench starts on loopback for the redis arm "
                        "(or give --redis-url); either adds the redis arm to the default arms")
    g.add_argument("--arms", metavar="A,B",
                   help="serve: arms to run, of recompute,gpu,host,layerwise,disk,redis,oracle (default "
                        "all but redis, which needs --redis-url or --redis-server)")
    g.add_argument("--segments", type=int,
                   help="serve: the measured requests are served in this many segments, every arm "
                        "taking its turn on each (default: one per 25 requests)")
    g.add_argument("--decode-tokens", type=int, help="serve: tokens the correctness check decodes")
    g.add_argument("--seed", type=int, help="serve: seed of the weights and the tokens")


def backend_of(args: argparse.Namespace, cuda_usable: Callable[[], bool]) -> str:
    """``auto`` is CUDA where usable, except with ``--quick``, which runs on the CPU backend."""
    if args.backend != "auto":
        return str(args.backend)
    return "cuda" if not args.quick and cuda_usable() else "cpu"


def serve_rows(args: argparse.Namespace, backend: str,
               say: Callable[[str], None]) -> tuple[list[BenchRow], dict[str, Any]]:
    """Run the serve bench as the options say; raises ValueError/FileNotFoundError on bad input."""
    from .config import ServeConfig
    from .run import run_serve_bench

    arms = tuple(a.strip() for a in args.arms.split(",")) if args.arms else None
    cfg = ServeConfig.defaults(
        backend=backend, quick=args.quick, mode=args.serve_mode, model=args.serve_model, layers=args.layers,
        traces=args.trace, requests=args.requests, warmup=args.warmup, block_tokens=args.block_tokens,
        max_tokens=args.max_tokens, prefixes=args.prefixes, prefix_tokens=args.prefix_tokens,
        suffix_tokens=args.suffix_tokens, compress=args.compress, load=args.load,
        gpu_blocks=args.gpu_blocks, host_blocks=args.host_blocks, disk_blocks=args.disk_blocks,
        redis_blocks=args.redis_blocks, redis_url=args.redis_url, redis_server=args.redis_server,
        tier_dir=args.tier_dir, policy=args.policy, arms=arms, segments=args.segments,
        decode_tokens=args.decode_tokens,
        seed=args.seed, loop=args.loop,
    )
    say(f"serve benchmark ({cfg.mode}) on the {backend} backend{' (quick)' if args.quick else ''}")
    return run_serve_bench(cfg, progress=say)
