"""A/B of the host submit: the bench's per-layer 32 KiB-page job (default worker), in
rounds alternating source trees (the older ones given, then the current one) in one device
call, because the lent host's speed drifts between minutes. For each tree a subprocess
times, per direction, 16 bursts of four jobs (``aiokv.bench.cuda._bursts``): each burst's
first submit (after an ``await``) and the others (back to back), with random chunks and
with the chunks as neighbours, then the device time of one job (GB/s). Medians in us.

Run on the GPU machine from the repo root, with each older tree unpacked somewhere, e.g.
``mkdir -p /tmp/old && git archive HEAD~3 aiokv | tar -x -C /tmp/old``, then
``python3 probes/probe_submit_ab.py /tmp/old [more trees] [--rounds N, default 3]``.
"""

import json
import os
import subprocess
import sys

SNIPPET = r"""
import asyncio, json, torch
from aiokv.bench import cuda as b
from _setups import per_layer

setup = per_layer(torch.device("cuda"))

async def main():
    ids = b._JobIds()
    out = {}
    async with setup.worker("auto") as w:
        for store in (True, False):
            await b._bursts(w, setup, store, ids, bursts=2)  # warm-up: the ring, the tables
            row = {}
            for runs in (False, True):
                warm, cold = await b._bursts(w, setup, store, ids, in_runs=runs, bursts=16)
                tag = "runs " if runs else ""
                row[tag + "back to back"], row[tag + "after await"] = warm * 1e6, cold * 1e6
            gbps, _ = await b._device_rate(w, setup, store, 8, ids)
            row["GB/s"] = gbps
            out["store" if store else "load"] = row
    print("JSON" + json.dumps(out))

asyncio.run(main())
"""


def main() -> None:
    args = sys.argv[1:]
    rounds = 3
    if "--rounds" in args:
        at = args.index("--rounds")
        rounds = int(args[at + 1])
        del args[at : at + 2]
    probes = os.path.dirname(os.path.abspath(__file__))
    trees = [(os.path.basename(os.path.normpath(p)), os.path.abspath(p)) for p in args]
    trees.append(("new", os.getcwd()))
    for r in range(rounds):
        for name, path in trees if r % 2 == 0 else trees[::-1]:
            paths = [path, probes, os.environ.get("PYTHONPATH", "")]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
            proc = subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True,
                                  text=True, cwd="/tmp")
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON")]
            if not lines:
                print(f"round {r} {name}: FAILED", proc.stderr[-2000:], flush=True)
                continue
            rows = json.loads(lines[0][4:])
            for direction, row in rows.items():
                cells = "  ".join(f"{k} {v:.0f}" if k != "GB/s" else f"{k} {v:.1f}" for k, v in row.items())
                print(f"round {r} {name:4} {direction:5}  {cells}", flush=True)


if __name__ == "__main__":
    main()
