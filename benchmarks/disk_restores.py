"""Several restores reading one disk tier at once: when does each finish, and what does the
tier give together, against plain reads of its own files?

Each restore reads its blocks as read calls of ``--batch`` blocks, all issued at once (as
``OffloadCache.restore`` issues its batches), a millisecond after the one before; with
``--writes``, demotion writes of new blocks run meanwhile. Printed per round: one restore
alone, then the restores together, each restore's end, the rate per restore (its bytes over
its own time, as ``aiokv bench serve`` counts it) and together (all bytes over the time
from the first start to the last end), beside the tier's read ceiling measured on the
same files. With ``--unordered`` the calls carry no order (each call for itself, as
before the tier served reads earliest restore first); docs/tiers.md, "Reads in arrival
order", has figures.
"""

from __future__ import annotations

import argparse
import mmap
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence

import anyio
import numpy as np

from aiokv import DiskTier
from aiokv.bench import disk_read_ceiling

PAGE = 16 << 10  # a block's parts: 16 KiB pages, the last first (as a host chunk keeps them)


def parts_of(area: memoryview, n: int, block: int) -> list[list[memoryview]]:
    pages = max(1, block // PAGE)
    size = block // pages
    return [[area[b * block + p * size: b * block + (p + 1) * size] for p in reversed(range(pages))]
            for b in range(n)]


async def measure(args: argparse.Namespace, directory: str) -> list[str]:
    block = args.block_kib << 10
    total = args.restores * args.blocks
    room = total + args.writes * args.batch * (args.rounds + 1) + 64
    tier = DiskTier(directory, capacity_bytes=room * block, io_threads=args.io_threads)
    await tier.open(b"disk-restores-benchmark")
    rng = np.random.default_rng(40)
    keys = [b"block-%06d" % i for i in range(total)]
    for at in range(0, total, 64):
        data = [memoryview(rng.integers(0, 256, block, dtype=np.uint8).tobytes()) for _ in keys[at:at + 64]]
        assert all(await tier.write(keys[at:at + 64], data))
    ceiling = await disk_read_ceiling(tier, min(64, total))
    area = mmap.mmap(-1, total * block)
    np.frombuffer(area, dtype=np.uint8)[:] = 1  # touched, as a host pool's chunks are
    parts = parts_of(memoryview(area), total, block)
    payload = [memoryview(rng.integers(0, 256, block, dtype=np.uint8).tobytes()) for _ in range(args.batch)]
    written = 0
    lines = [f"disk tier read ceiling {ceiling:.2f} GB/s ({tier.io_threads} I/O threads, direct I/O "
             f"{'on' if tier.direct else 'off'}); {args.restores} restores of {args.blocks} blocks of "
             f"{args.block_kib} KiB in calls of {args.batch}; {args.writes} write calls beside them; "
             f"reads {'unordered' if args.unordered else 'in arrival order'}"]

    async def restore(r: int, spans: list[tuple[float, float]], t0: float) -> None:
        await anyio.sleep(r * 1e-3)
        start = time.perf_counter()
        first = r * args.blocks
        async with anyio.create_task_group() as tg:
            for b in range(first, first + args.blocks, args.batch):
                order = None if args.unordered else (r, b)
                tg.start_soon(_read, tier, keys[b:b + args.batch], parts[b:b + args.batch], order)
        spans[r] = (start - t0, time.perf_counter() - t0)

    async def demote() -> None:
        nonlocal written
        for _ in range(args.writes):
            new = [b"demoted-%07d" % (written + j) for j in range(args.batch)]
            written += args.batch
            await tier.write(new, payload)

    nbytes = args.blocks * block
    for rnd in range(args.rounds):
        alone = [(0.0, 0.0)]
        await restore(0, alone, time.perf_counter())
        spans = [(0.0, 0.0)] * args.restores
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            if args.writes:
                tg.start_soon(demote)
            for r in range(args.restores):
                tg.start_soon(restore, r, spans, t0)
        each = [end - start for start, end in spans]
        per = args.restores * nbytes / sum(each) / 1e9
        together = args.restores * nbytes / (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e9
        one = nbytes / (alone[0][1] - alone[0][0]) / 1e9
        lines.append(f"round {rnd}: alone {one:.2f} GB/s ({one / ceiling:.2f}); together, ends "
                     + " ".join(f"{e * 1e3:.1f}" for _, e in spans)
                     + f" ms; per restore {per:.2f} GB/s ({per / ceiling:.2f}); "
                       f"together {together:.2f} GB/s ({together / ceiling:.2f})")
    await tier.aclose()
    return lines  # the mapping goes with the views of it


async def _read(tier: DiskTier, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]],
                order: tuple[int, int] | None) -> None:
    if not all(await tier.read_parts(keys, parts, order=order)):
        raise RuntimeError("a block did not read back")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small blocks, one round (seconds)")
    ap.add_argument("--dir", help="the folder to put the tier under (default: a temporary one)")
    ap.add_argument("--block-kib", type=int, default=512)
    ap.add_argument("--restores", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=32, help="blocks a restore reads")
    ap.add_argument("--batch", type=int, default=8, help="blocks a read call")
    ap.add_argument("--writes", type=int, default=0, help="write calls of --batch blocks beside them")
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--unordered", action="store_true", help="read calls without an order")
    args = ap.parse_args(argv)
    if args.quick:
        args.block_kib, args.blocks, args.batch, args.rounds = 64, 8, 4, 1
    base = tempfile.mkdtemp(prefix="aiokv-disk-restores-", dir=args.dir)
    try:
        for line in anyio.run(measure, args, base):
            print(line)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
