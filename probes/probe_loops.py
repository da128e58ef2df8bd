"""Wake-up of the bench's one-job rows on asyncio, uvloop and trio, in rounds.

The bench prints one wake-up row per loop (``aiokv bench``); this repeats the 4 KiB, the
2 MiB-page and the pitched 32 KiB-page job on each loop for several rounds, the order of
the loops rotating per round (the lent host's speed drifts between minutes), and prints
wake-up p50/p99, the median poll window, CPU while awaiting and submit (us) per round.
Run on the GPU machine from the repo root: ``python3 probes/probe_loops.py [rounds, default 3]``
(device run 70).
"""

import sys

import torch
from _setups import one_alloc, two_mib

from aiokv.bench import cuda as b


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    dev = torch.device("cuda")
    big, pitched = two_mib(dev), one_alloc(dev)
    loops = [name for name in ("asyncio", *b.OTHER_LOOPS) if b.loop_available(name)]
    jobs = {
        "4KiB": lambda: b._tiny_wakeups(300),
        "2MiB": lambda: b._long_wakeups(big, 100),
        "pitched": lambda: b._long_wakeups(pitched, 100),
    }
    for r in range(rounds):
        shift = r % len(loops)
        for loop in loops[shift:] + loops[:shift]:
            parts = []
            for name, job in jobs.items():
                w = b.run_on_loop(loop, job)
                parts.append(
                    f"{name} p50 {w['wake50'] * 1e6:.0f} p99 {w['wake99'] * 1e6:.0f} "
                    f"win {w['window50'] * 1e6:.0f} cpu {100 * w['cpu_wait']:.1f}% "
                    f"sub {w['submit'] * 1e6:.0f}"
                )
            print(f"round {r} {loop:8s}: " + "; ".join(parts), flush=True)


if __name__ == "__main__":
    main()
