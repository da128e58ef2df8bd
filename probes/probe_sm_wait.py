"""How long a small kernel on a high-priority stream waits for SMs while one GEMM runs:
does it start as soon as the GEMM's first CTAs retire, or only once the whole GEMM ends?

Why: one staged job alone under the 8192^3 GEMM reads 0.79-0.82 of the ceiling (run 86),
about 1.2 ms more per job than idle, spent waiting for SMs at the job's head (a store's
gather) or tail (a load's scatter). If the GEMM keeps its CTAs resident until it ends, no
launch order or priority gets a copy kernel in earlier, and only a second job in flight
(whose DMA covers the wait) hides it.

Each round: the GEMM alone on a normal stream, timed by events; the host waits until it
is well under way (a fraction of its measured length); then a one-CTA kernel (an add on
16 floats) goes on a high-priority stream, with events before and after it. Printed,
medians over the rounds, in us from the small kernel's enqueue: when it finished, and
when the GEMM ended. Idle: the same small kernel with nothing else running.

Run on the GPU machine from the repo root: python3 probes/probe_sm_wait.py [rounds, default 20]
"""

import statistics
import sys
import time

import torch

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
GEMMS = {"8192^3": (8192, 8192, 8192), "4096x4096x14336": (4096, 14336, 4096)}


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    dev = torch.device("cuda")
    low, high = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)
    small = torch.rand(16, device=dev) + 1.0

    def event() -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    with torch.cuda.stream(high):  # the small kernel alone, for reference
        for _ in range(5):
            small.add_(1.0)
        torch.cuda.synchronize()
        idle = []
        for _ in range(ROUNDS):
            a, b = event(), event()
            a.record()
            small.add_(1.0)
            b.record()
            b.synchronize()
            idle.append(a.elapsed_time(b) * 1e3)
    print(f"small kernel alone: {statistics.median(idle):.1f} us (median of {ROUNDS})", flush=True)

    for name, (m, k, n) in GEMMS.items():
        x = torch.rand(m, k, dtype=torch.bfloat16, device=dev)
        y = torch.rand(k, n, dtype=torch.bfloat16, device=dev)
        with torch.cuda.stream(low):
            for _ in range(3):
                x @ y
        torch.cuda.synchronize()
        lengths, done, ended = [], [], []
        for r in range(ROUNDS):
            g0, g1, s0, s1 = event(), event(), event(), event()
            with torch.cuda.stream(low):
                g0.record()
                x @ y
                g1.record()
            # Into the GEMM by a third of its length (its first round measures it).
            spin(lengths[0] / 3e6 if lengths else 0.4e-3)
            with torch.cuda.stream(high):
                s0.record()
                small.add_(1.0)
                s1.record()
            torch.cuda.synchronize()
            lengths.append(g0.elapsed_time(g1) * 1e3)
            if r:
                done.append(s0.elapsed_time(s1) * 1e3)
                ended.append(s0.elapsed_time(g1) * 1e3)
        print(f"{name}: GEMM {statistics.median(lengths):.0f} us; from the small kernel's enqueue, "
              f"it finished after {statistics.median(done):.0f} us "
              f"(range {min(done):.0f}-{max(done):.0f}), the GEMM ended after "
              f"{statistics.median(ended):.0f} us (range {min(ended):.0f}-{max(ended):.0f})", flush=True)


if __name__ == "__main__":
    main()
