"""``aiokv bench serve``: time to first token of requests served by an async server over
``OffloadCache`` on a Llama-shaped model, per arm (recompute, GPU prefix cache, host tier,
layerwise host loads, disk tier, an oracle at zero transfer time), each beside its computed
lower bound; the arms take turns segment by segment on the same requests.

The parts, each with one job: ``model`` (the decoder over a paged KV cache), ``workload``
(trace or prefix-repetition requests as tokens and block keys), ``pool`` (GPU blocks and
their prefix cache), ``sources`` (what serves blocks below the GPU pool), ``server`` (the
async server loop), ``arms`` (each arm's stack), ``measure`` (timing, ceilings,
calibration), ``report`` (rows, bounds, plot), ``compare`` (arms against each other, and
noise), ``correctness`` (greedy decode from restored KV), ``config``, ``run`` and ``cli``.
"""
