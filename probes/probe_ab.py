"""A/B of wake-up and submit: rounds alternating two source trees in one device call.

For each tree (``PYTHONPATH``), a subprocess runs the bench's one-job-at-a-time rows
(``_tiny_wakeups`` and ``_long_wakeups`` for the 2 MiB-page and the pitched 32 KiB-page job)
and prints wake-up p50/p99, median poll window, CPU while awaiting, submit and round trip
(us). Rounds alternate the order, because the lent host's speed drifts between minutes.
With ``busy``, a pure-Python thread spins beside (and a quarter of the jobs run). With
``perpage``, the rows are the per-layer 32 KiB-page job (one copy per page, issued by the
submit threads) instead.

Run on the GPU machine from the repo root, with the old tree unpacked somewhere, e.g.
``mkdir -p /tmp/old && git archive 5b658fe aiokv | tar -x -C /tmp/old``, then
``python3 probes/probe_ab.py /tmp/old [rounds, default 2] [busy] [perpage]`` (device runs
35-38; ``perpage``: run 53).
"""

import json
import os
import subprocess
import sys

SNIPPET = r"""
import asyncio, json, os, threading, torch
from aiokv.bench import cuda as b
dev, bf16 = torch.device("cuda"), torch.bfloat16
big = b._Setup("2 MiB", [torch.randn(b.BLOCKS, b.LAYERS, 2, 16, 8, 128, dtype=bf16, device=dev)],
               block_dim=0, chunks=b.CHUNKS // 2, seed=2)
layers = torch.randn(b.LAYERS, 2, b.BLOCKS, 16, 8, 128, dtype=bf16, device=dev)
one = b._Setup("32K one-alloc", list(layers.unbind(0)), block_dim=1, chunks=b.CHUNKS, seed=1)
share = 1
if os.environ.get("AB_BUSY"):
    share = 4
    def busy():
        n = 0
        while True:
            n += 1
    threading.Thread(target=busy, daemon=True).start()
if os.environ.get("AB_PERPAGE"):
    per_layer = b._Setup("32 KiB pages", [torch.randn(2, b.BLOCKS, 16, 8, 128, dtype=bf16, device=dev)
                                          for _ in range(b.LAYERS)], block_dim=1, chunks=b.CHUNKS, seed=1)
    out = {"per-page": asyncio.run(b._long_wakeups(per_layer, 100 // share))}
else:
    out = {
        "4KiB": asyncio.run(b._tiny_wakeups(300 // share)),
        "2MiB": asyncio.run(b._long_wakeups(big, 100 // share)),
        "pitched": asyncio.run(b._long_wakeups(one, 100 // share)),
    }
print("JSON" + json.dumps(out))
"""


def main() -> None:
    old = os.path.abspath(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    busy = "busy" in sys.argv[3:]
    trees = [("old", old), ("new", os.getcwd())]
    for r in range(rounds):
        for name, path in trees if r % 2 == 0 else trees[::-1]:
            paths = [path, os.environ.get("PYTHONPATH", "")]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
            if busy:
                env["AB_BUSY"] = "1"
            if "perpage" in sys.argv[3:]:
                env["AB_PERPAGE"] = "1"
            proc = subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True,
                                  text=True, cwd="/tmp")
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON")]
            if not lines:
                print(f"round {r} {name}: FAILED", proc.stderr[-2000:])
                continue
            rows = json.loads(lines[0][4:])
            print(f"round {r} {name}: " + "; ".join(
                f"{job} p50 {v['wake50'] * 1e6:.0f} p99 {v['wake99'] * 1e6:.0f} "
                f"win {v['window50'] * 1e6:.0f} cpu {v['cpu_wait'] * 100:.1f}% "
                f"sub {v['submit'] * 1e6:.0f} trip {v['trip50'] * 1e6:.0f}"
                for job, v in rows.items()), flush=True)


if __name__ == "__main__":
    main()
