"""The options of ``aiokv bench serve`` and the run they ask for (argparse only; the model
and the server load when the run starts)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..report import BenchRow

__all__ = ["add_serve_arguments", "backend_of", "serve_rows"]

def _defaults() -> tuple[Any, Any, Any]:
    """The defaults of a GPU run, of a CPU (or ``--quick``) run and of a prefix-mode run."""
    from .config import ServeConfig

    return (ServeConfig.defaults(backend="cuda", quick=False),
            ServeConfig.defaults(backend="cpu", quick=True),
            ServeConfig.defaults(backend="cpu", quick=True, mode="prefix"))


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options only ``aiokv bench serve`` reads; each help says its default (both, where a
    GPU run's and a CPU run's differ), read from ``ServeConfig.defaults``."""
    gpu, cpu, prefix = _defaults()

    def default(name: str) -> str:
        a, b = getattr(gpu, name), getattr(cpu, name)
        return f"default {a}" if a == b else f"default {a} on CUDA, {b} on the CPU and with --quick"

    g = parser.add_argument_group("serve", "what the run serves (see docs/serve.md)")
    g.add_argument("--mode", dest="serve_mode", choices=["trace", "prefix", "correctness"],
                   help="replay the trace (default), prefix repetition, or only the greedy-decode "
                        "correctness check")
    g.add_argument("--model", dest="serve_model", choices=["llama3-8b", "tiny"],
                   help=f"model shape ({default('model')})")
    g.add_argument("--layers", type=int, metavar="N",
                   help=f"decoder layers (default {gpu.model_config().layers} for llama3-8b, "
                        f"{cpu.model_config().layers} for tiny)")
    g.add_argument("--requests", type=int, metavar="N",
                   help=f"measured requests ({default('requests')}; prefix mode {prefix.requests})")
    g.add_argument("--warmup", type=int, metavar="N",
                   help=f"requests before them that only warm the caches ({default('warmup')}; "
                        f"prefix mode {prefix.warmup})")
    g.add_argument("--block-tokens", type=int, metavar="N",
                   help=f"tokens per 512-token trace block, which scales prompts ({default('block_tokens')})")
    g.add_argument("--max-tokens", type=int, metavar="N",
                   help=f"longest prompt; longer ones are cut ({default('max_tokens')})")
    g.add_argument("--prefixes", type=int, metavar="N",
                   help=f"--mode prefix: shared prefixes ({default('prefixes')})")
    g.add_argument("--prefix-tokens", type=int, metavar="N",
                   help=f"--mode prefix: tokens of each prefix ({default('prefix_tokens')})")
    g.add_argument("--suffix-tokens", type=int, metavar="N",
                   help=f"--mode prefix: tokens after the prefix ({default('suffix_tokens')})")
    g.add_argument("--compress", type=float, metavar="F",
                   help="divide trace timestamps by F (default: the factor that gives --load)")
    g.add_argument("--load", type=float, metavar="R",
                   help=f"offered load of the recompute arm that picks the compression ({default('load')})")
    g.add_argument("--gpu-blocks", type=int, metavar="N",
                   help="GPU KV pool in 16-token blocks (default: from the workload's reuse distances, "
                        "at least the largest request)")
    g.add_argument("--host-blocks", type=int, metavar="N",
                   help="host tier (OffloadCache) in blocks (default: from the workload's reuse distances)")
    g.add_argument("--disk-blocks", type=int, metavar="N",
                   help="disk tier in blocks (default: from the workload's reuse distances)")
    g.add_argument("--redis-blocks", type=int, metavar="N",
                   help="Redis tier in blocks (default: the disk tier's, at most an eighth of the "
                        "host's memory)")
    g.add_argument("--redis-url", metavar="URL",
                   help="the Redis/Valkey server of the redis arm, which then joins the default arms "
                        "(the bench deletes what it wrote)")
    g.add_argument("--redis-server", metavar="PATH",
                   help="a redis-server binary the bench starts on loopback for the redis arm, and "
                        "stops (instead of --redis-url; see .ci/redis-bundle.sh for a host without one)")
    g.add_argument("--arms", metavar="A,B",
                   help="arms to run, of recompute,gpu,host,layerwise,disk,redis,oracle (default: all "
                        "but redis, which joins them with --redis-url or --redis-server)")
    g.add_argument("--segments", type=int, metavar="N",
                   help="the measured requests are served in this many segments, every arm taking "
                        "its turn on each (default: one per 25 measured requests)")
    g.add_argument("--decode-tokens", type=int, metavar="N",
                   help=f"tokens the correctness check decodes ({default('decode_tokens')})")
    g.add_argument("--seed", type=int, metavar="N",
                   help=f"seed of the weights and the tokens ({default('seed')})")


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
