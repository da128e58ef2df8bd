"""``aiokv bench serve``: build the model and the workload, measure the ceilings, run every
arm on the same requests, check decoding from restored KV, and return the rows."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

from ..report import BenchRow
from .arms import Arm, ArmResult, new_kv_pools, open_arms, oracle_hits
from .compare import noise_rows, target_rows
from .config import ServeConfig
from .correctness import blocks_needed, decode_check
from .measure import Device, PrefillFit, load_ceiling, peak_flops
from .model import BLOCK_TOKENS, LlamaModel
from .pushes import push_rows
from .report import Ceilings, arm_rows
from .tier_rows import tier_rows
from .workload import Workload, describe, prefix_workload, trace_workload

__all__ = ["run_serve_bench"]

Progress = Callable[[str], None]


def run_serve_bench(cfg: ServeConfig,
                    progress: Progress | None = None) -> tuple[list[BenchRow], dict[str, Any]]:
    """Run what ``cfg`` asks for; the rows and a description of the run for ``meta``.

    On the CPU backend torch runs on one thread for the run (the copy lanes and the event
    loop have the other cores; a second torch thread on a busy 2-core host slows GEMMs
    erratically), and gets its thread count back afterwards.
    """
    cfg.check()
    say = progress or (lambda _msg: None)
    # The trace and the pool sizes given are checked before the model is built.
    workload = None if cfg.mode == "correctness" else _workload(cfg, cfg.model_config().vocab, say)
    if workload is not None:
        cfg.check_pools(workload)
    threads = torch.get_num_threads()
    if cfg.backend == "cpu":
        torch.set_num_threads(1)
    try:
        return anyio.run(_main, cfg, say, workload, backend=cfg.loop)
    finally:
        torch.set_num_threads(threads)


def _count(n: float) -> str:
    """A count for a reader: 111k, 7.0M, 6.98B (never 0.000111 B)."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:g}"


def _correctness_blocks(cfg: ServeConfig) -> int:
    return 64 if cfg.model == "llama3-8b" else 8


async def _main(cfg: ServeConfig, say: Progress,
                workload: Workload | None) -> tuple[list[BenchRow], dict[str, Any]]:
    device = Device(cfg.backend)
    mc = cfg.model_config()
    block_bytes = mc.block_bytes(cfg.dtype)
    say(f"model {mc.name}, {mc.layers} layers, {str(cfg.dtype).removeprefix('torch.')} on {device.kind}: "
        f"{_count(mc.params_per_layer() * mc.layers)} layer parameters, "
        f"{mc.page_bytes(cfg.dtype) >> 10} KiB K/V pages, {block_bytes / 2**20:.3g} MiB a block")
    model = LlamaModel(mc, device=device.kind, dtype=cfg.dtype, seed=cfg.seed)
    check_blocks = blocks_needed(_correctness_blocks(cfg), cfg.decode_tokens)
    meta: dict[str, Any] = {"serve": dataclasses.asdict(cfg),
                            "model": dataclasses.asdict(mc)}
    if cfg.mode == "correctness":
        say("correctness: greedy decode from restored KV against recomputed KV")
        return await _check(cfg, model, model.new_kv_cache(check_blocks), device, say), meta
    assert workload is not None
    say(describe(workload))
    cfg.resolve_pools(workload, block_bytes)
    assert cfg.gpu_blocks is not None
    say(f"pools (blocks of 16 tokens): GPU {cfg.gpu_blocks:,}, host {cfg.host_blocks:,}, "
        f"disk {cfg.disk_blocks:,}" + (f", Redis {cfg.redis_blocks:,}" if "redis" in cfg.arms else "")
        + f" (+{cfg.staging_blocks} staging)")
    kv = new_kv_pools(cfg, model)
    say("calibrating prefill time (also warms the model up)")
    fit = PrefillFit.measure(model, kv[cfg.kv_owners()[0]], device,
                             int(max(len(r.tokens) for r in workload.requests)), cfg.gpu_blocks)
    factor, offered = _compress(cfg, workload, fit)
    say(f"timestamps compressed {factor:.3g}x: estimated offered load of the recompute arm {offered:.2f}")
    ceil_bytes = 64 * block_bytes  # the KV of 1k tokens
    load_first, load_name = load_ceiling(device, ceil_bytes, mc.page_bytes(cfg.dtype))
    peak, peak_name = peak_flops(device, 1.0 if device.kind == "cuda" else 0.3)
    say(f"ceilings: load {load_first:.2f} GB/s ({load_name}); peak {peak / 1e12:.3g} TFLOP/s ({peak_name})")
    mirrored = cfg.mirrored_arm()
    async with AsyncExitStack() as stack:
        open_ = await open_arms(cfg, model, kv, device, stack, block_bytes=block_bytes, progress=say)
        await _serve_arms(cfg, workload, open_, mirrored, say)
        arms = {name: await arm.result(block_bytes) for name, arm in open_.items()}
        pushes = []
        if "layerwise" in arms:
            cached, new = _push_shape(arms["layerwise"])
            say(f"layerwise stores pushed from the forward: {new} tokens over {cached}, with and without")
            pushes = await push_rows(model, kv["layerwise"], device, cached=cached, new=new, seed=cfg.seed)
    del open_, kv
    device.empty_cache()
    load_last, _ = load_ceiling(device, ceil_bytes, mc.page_bytes(cfg.dtype))
    disk = arms["disk"].disk_ceiling if "disk" in arms else None
    ceil = Ceilings(max(load_first, load_last), load_name, peak, peak_name, block_bytes, disk)
    rows = _setup_rows(cfg, workload, ceil, (load_first, load_last), factor, offered, arms)
    for name, arm in arms.items():
        rows += arm_rows(arm, ceil, mc, recompute=arms.get("recompute"),
                         mirrors=f"mirrors {mirrored}" if name == "oracle" else None)
    rows += target_rows(arms, mirrored, ceil, layerwise_oracle=1.10 if cfg.mode == "prefix" else 1.15)
    rows += tier_rows(arms, ceil)
    rows += pushes
    rows += noise_rows(arms, mirrored)
    rows += await _check(cfg, model, model.new_kv_cache(check_blocks), device, say)
    meta["workload"] = describe(workload)
    meta["compression"] = factor
    return rows, meta


async def _serve_arms(cfg: ServeConfig, workload: Workload, arms: dict[str, Arm], mirrored: str | None,
                      say: Progress) -> None:
    """Warm the caching arms, then serve the measured requests segment by segment, every
    arm taking its turn on each segment (``ServeConfig.turns``): the arms share the
    machine's good and bad moments instead of each having its own stretch of the run."""
    for arm in arms.values():
        if arm.warms and workload.warm:
            say(f"arm {arm.name}: warming its caches with {len(workload.warm)} requests")
            await arm.server.warm(workload.warm)
    segments = workload.segments(cfg.segment_count(len(workload.measured)))
    for k, requests in enumerate(segments):
        t0 = time.perf_counter()
        p50 = []
        for name in cfg.turns(k):
            arm = arms[name]
            if name == "oracle" and mirrored is not None:
                assert arm.server.oracle is not None
                arm.server.oracle.update(oracle_hits(arms[mirrored].served[-len(requests):]))
            gc.collect()  # each turn starts without the garbage of the ones before
            served = await arm.server.serve(requests, k)
            arm.served += served
            p50.append(f"{name} {np.median([s.ttft for s in served]) * 1e3:.1f}")
        say(f"segment {k + 1}/{len(segments)} ({len(requests)} requests, {time.perf_counter() - t0:.1f} s): "
            "TTFT p50 ms " + ", ".join(p50))


async def _check(cfg: ServeConfig, model: LlamaModel, kv: list[torch.Tensor], device: Device,
                 say: Progress) -> list[BenchRow]:
    rows = await decode_check(model, kv, device, prompt_blocks=_correctness_blocks(cfg),
                              decode_tokens=cfg.decode_tokens, tier_dir=cfg.tier_dir, seed=cfg.seed)
    say("correctness: " + "; ".join(f"{r.name}: {r.note}" for r in rows))
    return rows


def _workload(cfg: ServeConfig, vocab: int, say: Progress) -> Workload:
    assert cfg.requests is not None and cfg.warmup is not None
    if cfg.mode == "prefix":
        assert cfg.prefix_tokens is not None and cfg.suffix_tokens is not None
        return prefix_workload(prefixes=cfg.prefixes, prefix_tokens=cfg.prefix_tokens,
                               suffix_tokens=cfg.suffix_tokens, requests=cfg.requests,
                               warmup=cfg.warmup, vocab=vocab, seed=cfg.seed)
    from ..cache import find_traces
    from ..trace import FULL_TRACES, PACKAGED_TRACE

    try:
        paths = find_traces(cfg.traces)
    except FileNotFoundError:
        if cfg.traces:
            raise
        paths = [PACKAGED_TRACE]
        say(f"no full Mooncake trace found: replaying the {PACKAGED_TRACE.name} slice shipped with aiokv "
            f"(the first 400 requests of the conversation trace; the full ones: {FULL_TRACES})")
    if cfg.traces and len(paths) > 1:
        raise ValueError(f"serve replays one trace; --trace named {len(paths)} files")
    path = next((p for p in paths if Path(p).stem.startswith("conversation")), paths[0])
    assert cfg.block_tokens is not None and cfg.max_tokens is not None
    workload = trace_workload(path, requests=cfg.requests, warmup=cfg.warmup, block_tokens=cfg.block_tokens,
                              max_tokens=cfg.max_tokens, vocab=vocab, seed=cfg.seed)
    if path == PACKAGED_TRACE and len(workload.requests) < cfg.warmup + cfg.requests:
        raise ValueError(
            f"the trace slice shipped with aiokv holds {len(workload.requests)} requests, and this run "
            f"asks for {cfg.warmup + cfg.requests} (--warmup {cfg.warmup} + --requests {cfg.requests}); "
            f"pass --trace with the full conversation_trace.jsonl from {FULL_TRACES}, or ask for fewer")
    return workload


def _push_shape(arm: ArmResult) -> tuple[int, int]:
    """A typical request of the layerwise arm: (tokens it reused, tokens it computed), the
    medians over its host hits (over every request where it had none)."""
    hits = [s for s in arm.served if s.host_tokens] or arm.served
    if not hits:
        return 0, 16 * BLOCK_TOKENS
    reused = int(np.median([s.gpu_tokens + s.host_tokens for s in hits]))
    return reused, max(BLOCK_TOKENS, int(np.median([s.computed for s in hits])))


def _compress(cfg: ServeConfig, workload: Workload, fit: PrefillFit) -> tuple[float, float]:
    """The compression factor (given, or the one that offers the recompute arm ``cfg.load``
    of the model's time, by the calibration) and the offered load it gives."""
    work = sum(fit(len(r.tokens)) for r in workload.measured)
    span = workload.span_seconds
    if span <= 0:  # every request arrives at once
        workload.compress(1.0)
        return 1.0, float("inf")
    factor = cfg.compress if cfg.compress is not None else cfg.load * span / work
    workload.compress(factor)
    return factor, work / (span / factor)


def _setup_rows(cfg: ServeConfig, workload: Workload, ceil: Ceilings, loads: tuple[float, float],
                factor: float, offered: float, arms: dict[str, ArmResult]) -> list[BenchRow]:
    mc = cfg.model_config()
    section = (f"serve setup: {mc.name} x{mc.layers} layers on {cfg.backend}, {workload.name}, "
               f"{len(workload.measured)} requests")
    mib = ceil.block_bytes / 2**20
    rows = [
        BenchRow(section, "load ceiling", ceil.load_gbps, "GB/s",
                 note=f"{ceil.load_name}; best of start {loads[0]:.2f} / end {loads[1]:.2f}"),
        BenchRow(section, "peak FLOP/s", ceil.peak_flops / 1e12, "TFLOP/s", note=f"peak: {ceil.peak_name}"),
        BenchRow(section, "timestamp compression", factor, "x",
                 note=f"offered load of the recompute arm ~{offered:.2f} (prefill calibration)"
                 if cfg.compress is None else "given with --compress"),
    ]
    for name, label in (("disk", "disk tier read ceiling"), ("redis", "Redis GET ceiling")):
        if name in arms:
            tiered = arms[name]
            rows.append(BenchRow(section, label, tiered.disk_ceiling, "GB/s",
                                 note=tiered.ceiling_name if tiered.disk_ceiling
                                 else f"not measured: {tiered.disk_ceiling_error}"))
    for name, blocks in (("GPU pool", cfg.gpu_blocks), ("host pool", cfg.host_blocks),
                         ("disk tier", cfg.disk_blocks), ("Redis tier", cfg.redis_blocks)):
        assert blocks is not None
        if name == "Redis tier" and "redis" not in arms:
            continue
        rows.append(BenchRow(section, name, float(blocks), "blocks",
                             note=f"{blocks * mib:,.1f} MiB; {BLOCK_TOKENS} tokens a block"))
    return rows
