"""The tiers' own thread: an event loop that opens the tiers and runs every read, write and
lookup the scheduler's manager asks for, so no tier I/O runs under vLLM's scheduler lock.

The manager hands over one operation per block (``submit``) and takes the answers back on
its next call (``results``); both only touch a queue. The loop takes whatever has queued
since it last looked as one batch per tier, so the blocks one scheduler step asks for
travel together. Bytes go straight between the shared host pools and the tiers where a
block's pages lie in the layout's order (else through one row each). A tier call that
fails, times out or breaks its contract answers False for its blocks, as does anything
else a batch raises (the thread serves on), and work handed over once the thread has ended
is answered False at once: the manager turns that into a miss or a dropped write, never
into a hit, and nothing stays in flight. Kept free of vLLM imports.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.to_thread
import numpy as np

from ...cache.tiers.base import Tier, TierStatistics
from .shared_pool import PoolView

__all__ = ["BATCH_KEYS", "Done", "Op", "TierIO"]

_log = logging.getLogger("aiokv")

BATCH_KEYS = 64
"""Blocks one tier call carries at most; a larger batch is several calls at once."""
_INLINE_COPY = 1 << 20  # bytes of pages rearranged on the loop; more goes to a thread

Kind = Literal["promote", "write", "locate"]


@dataclass(frozen=True)
class Op:
    """One block's tier work: read it from ``tier`` into ``chunk`` (promote), write it from
    ``chunk`` to ``tier`` (write), or find which remote tier holds it (locate)."""

    kind: Kind
    key: Any
    group: int = 0
    chunk: int = -1
    tier: int = -1
    tag: str = ""  # the manager's own label ("demote", "through")


@dataclass(frozen=True)
class Done:
    """An operation's answer: whether it worked, and the tier that served or took it (-1:
    none)."""

    op: Op
    ok: bool
    tier: int = -1
    nbytes: int = 0


@dataclass
class _Batch:
    kind: Kind
    tier: int
    ops: list[Op] = field(default_factory=list)


class TierIO:
    """Runs the tiers of one manager on a thread of their own.

    Args:
        tiers: the tiers, nearest first (not opened yet).
        drain_timeout: seconds ``close`` waits for work in flight before it cancels it.
    """

    def __init__(self, tiers: Sequence[Tier], *, drain_timeout: float = 10.0) -> None:
        self.tiers = list(tiers)
        self.drain_timeout = float(drain_timeout)
        self.view: PoolView | None = None
        self.disabled: set[int] = set()
        self.errors: list[str] = []
        self._ops: list[Op] = []
        self._done: deque[Done] = deque()
        self._lock = threading.Lock()
        self._wake_pending = False
        self._in_flight = 0  # ops submitted and not answered (scheduler's count)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stopping = False
        self._ended = False  # the thread has ended: work handed over now is answered at once
        self._opened = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the scheduler's side ---------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether the tiers are open and serving (a tier that failed to open is left out)."""
        return self._opened.is_set() and not self._stopping

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def usable(self, index: int) -> bool:
        return self.ready and index not in self.disabled

    def start(self, view: PoolView, fingerprint: bytes) -> None:
        """Open the tiers for this layout on the thread (returns at once; ``ready`` later)."""
        if self._thread is not None:
            return
        self.view = view
        self._thread = threading.Thread(target=self._run_loop, args=(fingerprint,),
                                        name="aiokv-tiers", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float) -> bool:
        """Block until the tiers are open (tests and warm restarts); whether they are."""
        return self._opened.wait(timeout)

    def holds(self, key: Any) -> int:
        """The nearest open local tier holding every rank's block of ``key`` (-1: none).

        Asked on the scheduler's thread: ``Tier.holds`` does no I/O and only reads the
        tier's index, and an answer made stale by the tier's thread costs a miss at most
        (a read verifies every block)."""
        view = self.view
        if view is None or not self.ready:
            return -1
        for i, tier in enumerate(self.tiers):
            if tier.remote or i in self.disabled:
                continue
            try:
                if all(tier.holds(view.tier_key(key, r)) for r in range(len(view.ranks))):
                    return i
            except Exception:  # a tier not open, or broken: not here
                continue
        return -1

    def submit(self, ops: Sequence[Op]) -> None:
        """Queue work for the thread (never waits); answers come back through ``results``."""
        if not ops:
            return
        with self._lock:
            self._in_flight += len(ops)
            if self._ended:  # nobody will serve it: failed, so its chunks are freed
                self._done.extend(Done(op, False) for op in ops)
                return
            self._ops.extend(ops)
            wake = not self._wake_pending and self._loop is not None
            self._wake_pending = self._wake_pending or wake
        if wake:
            self._kick()

    def results(self) -> list[Done]:
        """Answers since the last call, oldest first."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        with self._lock:
            self._in_flight -= len(out)
        return out

    def statistics(self) -> list[TierStatistics | None]:
        """Each tier's counters (None for a tier that could not say)."""
        out: list[TierStatistics | None] = []
        for tier in self.tiers:
            try:
                out.append(tier.statistics())
            except Exception:
                out.append(None)
        return out

    def close(self) -> None:
        """Finish or cancel the work in flight (``drain_timeout``), close every tier and end
        the thread; at most a little more than ``drain_timeout`` seconds."""
        self._stopping = True
        thread = self._thread
        if thread is None:
            return
        self._kick()
        thread.join(self.drain_timeout + 5.0)
        if thread.is_alive():
            _log.warning("aiokv: the tiers' thread did not end within %.0f s; left running",
                         self.drain_timeout + 5.0)

    def _kick(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop is closed: nothing to wake
                pass

    # -- the thread -------------------------------------------------------------------------

    def _run_loop(self, fingerprint: bytes) -> None:
        try:
            asyncio.run(self._main(fingerprint))
        except BaseException:  # the tiers are gone; the manager sees not ready and misses
            _log.exception("aiokv: the tiers' thread failed; tiers are off")
        finally:
            with self._lock:  # never served: failed, so the manager frees their chunks
                self._ended = True
                left, self._ops = self._ops, []
            self._done.extend(Done(op, False) for op in left)
            self._opened.clear()

    async def _main(self, fingerprint: bytes) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        view = self.view
        assert view is not None
        opened: list[Tier] = []
        for i, tier in enumerate(self.tiers):
            try:
                tier.check_block_bytes(view.block_bytes)
                await tier.open(fingerprint)
                opened.append(tier)
            except Exception as exc:
                self.disabled.add(i)
                self.errors.append(f"{tier.name}: {exc}")
                _log.error("aiokv: tier %d (%s) could not open and is left out: %s", i, tier.name, exc)
        self._opened.set()
        idle = anyio.Event()
        running = [0]
        try:
            async with anyio.create_task_group() as tg:
                while not self._stopping:
                    with self._lock:
                        ops, self._ops = self._ops, []
                        self._wake_pending = False
                    for batch in _batches(ops):
                        running[0] += 1
                        tg.start_soon(self._serve, batch, running, idle)
                    if not ops:
                        await self._wake.wait()
                        self._wake.clear()
                with anyio.move_on_after(self.drain_timeout):
                    while running[0]:
                        await idle.wait()
                        idle = anyio.Event() if running[0] else idle
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.drain_timeout):
                for tier in opened:
                    try:
                        await tier.aclose()
                    except Exception:
                        _log.warning("aiokv: closing tier %s failed", tier.name, exc_info=True)

    async def _serve(self, batch: _Batch, running: list[int], idle: anyio.Event) -> None:
        answered: list[Done] = []
        try:
            if batch.kind == "promote":
                answered = await self._promote(batch)
            elif batch.kind == "write":
                answered = await self._write(batch)
            else:
                answered = await self._locate(batch)
        except Exception:  # a bug or a broken mapping, outside the tier's call: these
            # blocks fail (misses, drops); the thread and every other batch go on
            _log.exception("aiokv: %d %s operation(s) on tier %d failed", len(batch.ops), batch.kind,
                           batch.tier)
            answered = [Done(op, False) for op in batch.ops]
        except BaseException:
            answered = answered or [Done(op, False) for op in batch.ops]
            raise
        finally:
            self._done.extend(answered)
            running[0] -= 1
            if not running[0]:
                idle.set()

    async def _promote(self, batch: _Batch) -> list[Done]:
        view = self.view
        assert view is not None
        tier = self.tiers[batch.tier]
        keys, outs, rows = _rank_buffers(view, batch.ops, zeroed=False)
        got = await _call(tier.read(keys, outs), len(keys), tier.name)
        answers = _answers(view, batch, got)
        read = {id(done.op) for done in answers if done.ok}
        placed = [(op, r, row) for op, r, row in rows if id(op) in read]
        if placed:
            def place() -> None:
                for op, r, row in placed:
                    view.ranks[r].scatter(op.group, op.chunk, row)

            await _off_loop(len(placed) * view.block_bytes, place)
        return answers

    async def _write(self, batch: _Batch) -> list[Done]:
        view = self.view
        assert view is not None
        tier = self.tiers[batch.tier]
        keys, views, gathers = _rank_buffers(view, batch.ops, zeroed=True)
        if gathers:
            def gather() -> None:
                for op, r, row in gathers:
                    view.ranks[r].gather(op.group, op.chunk, row)

            await _off_loop(len(gathers) * view.block_bytes, gather)
        got = await _call(tier.write(keys, views), len(keys), tier.name)
        return _answers(view, batch, got)

    async def _locate(self, batch: _Batch) -> list[Done]:
        """Which remote tier holds every rank's block of each key, nearest first."""
        view = self.view
        assert view is not None
        nranks = len(view.ranks)
        found = [-1] * len(batch.ops)
        for t, tier in enumerate(self.tiers):
            if not tier.remote or t in self.disabled:
                continue
            want = [i for i, f in enumerate(found) if f < 0]
            if not want:
                break
            keys = [view.tier_key(batch.ops[i].key, r) for i in want for r in range(nranks)]
            got = await _call(tier.exists(keys), len(keys), tier.name)
            for j, i in enumerate(want):
                if all(got[j * nranks: (j + 1) * nranks]):
                    found[i] = t
        return [Done(op, f >= 0, f) for op, f in zip(batch.ops, found)]


_Row = tuple[Op, int, np.ndarray]


def _rank_buffers(view: PoolView, ops: Sequence[Op], *,
                  zeroed: bool) -> tuple[list[bytes], list[memoryview], list[_Row]]:
    """Each op's tier key and bytes, rank by rank: the rank's block itself where it fills a
    whole tier value, else a row of its own, listed with its op and rank for the scatter
    after a read or the gather before a write (``zeroed`` for a write: a value's bytes past
    the payload are zeros, never stale memory)."""
    keys, buffers, rows = [], [], []
    for op in ops:
        for r in range(len(view.ranks)):
            keys.append(view.tier_key(op.key, r))
            direct = view.ranks[r].block(op.group, op.chunk) \
                if view.payload(r, op.group) == view.block_bytes else None
            if direct is None:
                row = (np.zeros if zeroed else np.empty)(view.block_bytes, dtype=np.uint8)
                rows.append((op, r, row))
                direct = memoryview(row.data)
            buffers.append(direct)
    return keys, buffers, rows


def _answers(view: PoolView, batch: _Batch, got: list[bool]) -> list[Done]:
    """Each op of a read or write batch done where the tier answered True for every rank's
    value of it (``got`` lists them as ``_rank_buffers`` did), with the bytes it moved."""
    nranks = len(view.ranks)
    out = []
    for i, op in enumerate(batch.ops):
        good = all(got[i * nranks: (i + 1) * nranks])
        out.append(Done(op, good, batch.tier if good else -1,
                        sum(view.payload(r, op.group) for r in range(nranks)) if good else 0))
    return out


def _batches(ops: list[Op]) -> list[_Batch]:
    """Ops grouped by kind and tier, ``BATCH_KEYS`` at most."""
    groups: dict[tuple[Kind, int], list[Op]] = {}
    for op in ops:
        groups.setdefault((op.kind, op.tier if op.kind != "locate" else -1), []).append(op)
    out = []
    for (kind, tier), members in groups.items():
        for start in range(0, len(members), BATCH_KEYS):
            out.append(_Batch(kind, tier, members[start: start + BATCH_KEYS]))
    return out


async def _call(call: Any, n: int, name: str) -> list[bool]:
    """A tier call's answers; anything it raises (a tier breaking its contract) is n misses."""
    try:
        got = list(await call)
    except Exception:
        _log.warning("aiokv: a call to the %s tier raised; its blocks count as misses", name, exc_info=True)
        return [False] * n
    if len(got) != n:
        return [False] * n
    return [bool(g) for g in got]


async def _off_loop(nbytes: int, fn: Any) -> None:
    """Rearrange pages on the loop when small, else on a worker thread (not abandoned when
    cancelled: the memory it touches is handed back only after)."""
    if nbytes <= _INLINE_COPY:
        fn()
    else:
        await anyio.to_thread.run_sync(fn)
