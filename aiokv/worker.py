"""``AsyncOffloadingWorker``: submit returns at once with an awaitable future."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Literal, overload

import anyio
import anyio.abc
import anyio.lowlevel

from .core import OffloadCore
from .doorbell import Doorbell
from .errors import UsageError
from .facts import WorkerFacts
from .future import TransferFuture
from .handler import Job
from .layer_future import LayerWatch, LayerwiseFuture
from .layout import CanonicalKVCaches
from .lifecycle import State
from .loops import LoopEvent, loop_event
from .options import WorkerOptions
from .poller import CompletionForecast, Poller, PollerStatistics
from .specs import Direction, flag

__all__ = ["AsyncOffloadingWorker"]

_MAX_DRAIN_NAP = 1e-3


class AsyncOffloadingWorker(WorkerFacts):
    """Moves KV blocks between device memory and a host pool; every transfer is awaitable.

    Use as ``async with AsyncOffloadingWorker(kv, num_cpu_chunks=...) as worker:``. The
    context starts one poller task on the current event loop (asyncio, uvloop or trio) and,
    on exit, waits for every job in flight before it frees host memory.

    Submits never wait for a copy: a tight loop can queue thousands of jobs at once, and
    closing then drains them all. Set ``options={"max_in_flight": n}`` to bound the jobs in
    flight: a submit past the bound raises ``QueueFull`` before enqueueing, and
    ``await worker.wait_for_room()`` returns once a slot is free.

    Args:
        kv_caches: the KV cache to serve (``CanonicalKVCaches.from_tensors(...)``, or an
            engine's object with the same fields, such as vLLM's).
        num_cpu_chunks: host pool size in chunks (pass this or ``cpu_bytes``).
        cpu_bytes: host pool size in bytes, rounded down to whole chunks.
        blocks_per_chunk: consecutive GPU blocks one host chunk holds.
        backend: ``"auto"`` (where the tensors live), ``"cuda"`` or ``"cpu"``.
        strategy: CUDA copy strategy, ``"auto" | "dma" | "kernel" | "staged"``.
        options: further knobs, a ``WorkerOptions`` or a dict.

    Raises:
        InvalidSpec: bad sizes, options, backend or KV-cache description.
        HostMemoryError: the host pool is larger than the memory available, or could not
            be allocated.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        *,
        num_cpu_chunks: int | None = None,
        cpu_bytes: int | None = None,
        blocks_per_chunk: int = 1,
        backend: str = "auto",
        strategy: str | None = None,
        options: WorkerOptions | Mapping[str, Any] | None = None,
    ) -> None:
        self._core = OffloadCore(
            kv_caches, num_cpu_chunks=num_cpu_chunks, cpu_bytes=cpu_bytes,
            blocks_per_chunk=blocks_per_chunk, backend=backend, strategy=strategy, options=options,
        )
        self._lifecycle = self._core.lifecycle
        self._futures: dict[int, TransferFuture] = {}
        self._poller: Poller | None = None
        self._forecast = CompletionForecast()
        self._task_group: anyio.abc.TaskGroup | None = None
        # The poller runs in its own scope, so any task can stop it without cancelling the
        # opener's body (which runs inside the task group's scope).
        self._poller_scope: anyio.CancelScope | None = None
        self._opener: int | None = None  # the task that entered the task group
        self._bell: Doorbell | None = None
        # Per head job asked to ring the bell: True if it will, None if it cannot.
        self._armed: dict[Job, bool | None] = {}
        self._watch = LayerWatch(self._wake_poller)  # awaited layers of layerwise jobs
        # Set when a poll finished jobs, for tasks in ``wait_for_room``.
        self._room: LoopEvent | None = None
        self._loop_thread: int | None = None

    # -- facts --------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Jobs submitted whose futures are not resolved yet."""
        return len(self._futures)

    def poller_statistics(self) -> PollerStatistics:
        """What the poller did so far: polls, naps, and how late each job's end was noticed
        (``PollerStatistics.detect_windows``). Zeros before the worker is opened."""
        windows = tuple(self._forecast.detect_windows)
        if self._poller is None:
            return PollerStatistics(0, 0, windows)
        return self._poller.statistics(windows)

    def __repr__(self) -> str:
        return f"<AsyncOffloadingWorker {self._lifecycle.state.value} {self._core.describe()}>"

    # -- submitting ---------------------------------------------------------------------

    @overload
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any, *, after: Any = None,
                     layerwise: Literal[False] = False) -> TransferFuture: ...

    @overload
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any, *, after: Any = None,
                     layerwise: Literal[True]) -> LayerwiseFuture: ...

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any, *, after: Any = None,
                     layerwise: bool = False) -> TransferFuture:
        """Enqueue a GPU -> host copy and return its future at once.

        ``layerwise=True`` returns a ``LayerwiseFuture``: nothing is copied until each
        layer is pushed (``fut.push(i)``), behind the compute that wrote it
        (docs/layerwise.md).

        Raises:
            InvalidSpec: bad input (nothing was enqueued); ``DuplicateJob`` for an id in flight.
            QueueFull: ``max_in_flight`` jobs are in flight already.
            WorkerClosed: the worker is not open, or closed.
            UsageError: called off the loop thread that opened the worker.
            WorkerBroken: the device failed under the worker.
        """
        if flag("layerwise", layerwise):
            return self._submit_layers(Direction.STORE, job_id, src_spec, dst_spec, after)
        return self._submit(Direction.STORE, job_id, src_spec, dst_spec, after)

    @overload
    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, *, expedited: bool = False,
                    after: Any = None, layerwise: Literal[False] = False) -> TransferFuture: ...

    @overload
    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, *, expedited: bool = False,
                    after: Any = None, layerwise: Literal[True]) -> LayerwiseFuture: ...

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, *, expedited: bool = False,
                    after: Any = None, layerwise: bool = False) -> TransferFuture:
        """Enqueue a host -> GPU copy; ``expedited`` loads never wait behind ordinary ones.
        ``layerwise=True`` enqueues every layer now, each layer's end marked behind its
        copies, and returns a ``LayerwiseFuture`` (``await fut.layer(i)``, ``fut.gate(i)``;
        docs/layerwise.md). Raises what ``submit_store`` raises."""
        direction = Direction.of_load(expedited)
        if flag("layerwise", layerwise):
            return self._submit_layers(direction, job_id, src_spec, dst_spec, after)
        return self._submit(direction, job_id, src_spec, dst_spec, after)

    def _submit_layers(self, direction: Direction, job_id: int, src: Any, dst: Any,
                       after: Any) -> LayerwiseFuture:
        self._check_caller()
        job = self._core.submit_layers(direction, job_id, src, dst, after, reserved=self._futures)
        future = LayerwiseFuture(job, self._watch)
        self._futures[job.job_id] = future
        assert self._poller is not None
        self._poller.wake()
        return future

    def _submit(self, direction: Direction, job_id: int, src: Any, dst: Any, after: Any) -> TransferFuture:
        self._check_caller()
        job = self._core.submit(direction, job_id, src, dst, after, reserved=self._futures)
        future = TransferFuture(job.job_id)
        self._futures[job.job_id] = future
        assert self._poller is not None
        self._poller.wake()
        return future

    def _check_caller(self) -> None:
        """The lifecycle and the thread: everything else is the core's to check."""
        self._lifecycle.check_open()
        if threading.get_ident() != self._loop_thread:
            raise UsageError(
                "submit_* must be called on the event loop thread that opened the worker; "
                "engine threads use SyncOffloadingWorker"
            )

    def check_submittable(self, after: Any = None) -> None:
        """Raise what ``submit_*`` would raise for this worker's state, the calling thread,
        or ``after`` (checked without recording anything)."""
        self._check_caller()
        self._core.check_ready(after)

    def check_store(self, src_spec: Any, dst_spec: Any, *, after: Any = None) -> None:
        """Raise what ``submit_store`` would raise for these specs (ids, lengths, sides),
        ``after`` and this worker's state, without enqueueing anything. Callers that submit
        several jobs for one request (the cache) check them all first."""
        self._check_caller()
        self._core.check(Direction.STORE, None, src_spec, dst_spec, after)

    def check_load(
        self, src_spec: Any, dst_spec: Any, *, expedited: bool = False, after: Any = None
    ) -> None:
        """Raise what ``submit_load`` would raise for these specs, ``after`` and this
        worker's state, without enqueueing anything."""
        self._check_caller()
        self._core.check(Direction.of_load(expedited), None, src_spec, dst_spec, after)

    async def wait_for_room(self) -> None:
        """Return once a submit would pass the ``max_in_flight`` bound (at once, past a
        checkpoint, when it would already or no bound is set). Cancellable; raises
        ``WorkerClosed`` if the worker closes meanwhile."""
        self._check_caller()
        core = self._core
        if core.has_room():
            await anyio.lowlevel.checkpoint()
            return
        while not core.has_room():
            if self._room is None:
                self._room = loop_event()
            await self._room.wait()
            self._lifecycle.check_open()

    def _wake_poller(self) -> None:
        if self._poller is not None:
            self._poller.wake()

    def _complete_finished(self) -> int:
        done = self._core.poll()
        if not done:
            return self._watch.poll() if self._watch.waiting else 0
        self._forecast.saw(done)
        escaped = self._resolve(done)
        if escaped is not None:
            raise escaped
        return len(done) + (self._watch.poll() if self._watch.waiting else 0)

    def _settle(self) -> None:
        self._core.settle()
        self._forecast.learn()

    def _expected_wait(self) -> float | None:
        forecast = self._forecast
        if not forecast.has_rate:  # nothing learned yet: skip the heads' lookup
            return None
        return forecast.expected_wait(self._core.heads())

    def _resolve(self, done: list[Job]) -> BaseException | None:
        """Resolve every popped job's future (the core has forgotten them already), even if
        a done callback raises a BaseException (Exceptions are logged by the future); the
        first such exception is returned."""
        escaped: BaseException | None = None
        armed = self._armed
        for job in done:
            assert job.result is not None
            if armed:
                armed.pop(job, None)
            future = self._futures.pop(job.job_id)
            try:
                future._resolve(job.result, job.error)
            except BaseException as exc:
                escaped = escaped or exc
        room = self._room
        if room is not None:  # tasks waiting for room re-check the bound
            self._room = None
            room.set()
        return escaped

    def _arm_heads(self) -> bool:
        """Have each direction's oldest job ring the doorbell as it ends; False if one cannot."""
        bell = self._bell
        assert bell is not None
        armed = True
        for job in self._core.heads():
            state = self._armed.get(job, False)
            if state is False:  # asked once: None means it cannot ring
                state = self._armed[job] = True if job.completion.ring_when_done(bell) else None
            armed = armed and state is True
        if self._watch.waiting:
            armed = self._watch.arm(bell) and armed
        return armed

    # -- lifetime -----------------------------------------------------------------------

    async def __aenter__(self) -> AsyncOffloadingWorker:
        self._lifecycle.open()
        try:
            opts = self._core.options
            self._bell = Doorbell() if opts.doorbell and Doorbell.supported() else None
            self._poller = Poller(
                self._complete_finished,
                lambda: len(self._futures),
                expected_wait=self._expected_wait,
                settle=self._settle,
                bell=self._bell,
                arm=self._arm_heads if self._bell is not None else None,
                spin_seconds=opts.spin_seconds,
                poll_interval=opts.poll_interval,
            )
            self._task_group = anyio.create_task_group()
            await self._task_group.__aenter__()
        except BaseException:
            self._close_bell()
            self._lifecycle.begin_close()
            self._core.close()
            raise
        self._poller_scope = anyio.CancelScope()
        self._task_group.start_soon(self._run_poller, self._poller, self._poller_scope)
        self._opener = anyio.get_current_task().id
        self._loop_thread = threading.get_ident()
        return self

    @staticmethod
    async def _run_poller(poller: Poller, scope: anyio.CancelScope) -> None:
        with scope:
            if not scope.cancel_called:  # closed before it ever ran: the bell is gone
                await poller.run()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    async def aclose(self, *, drain_timeout: float | None = None) -> None:
        """Wait for every job in flight, stop the poller and free host memory. Idempotent.

        Any task on the opener's loop may call it (another thread must hand it to that
        loop: it raises ``UsageError`` there unless closed already). The drain is shielded
        from anyio cancel scopes, so cancelling the closing task does not abandon copies
        that still write host memory; but it ends: once no job has ended for
        ``drain_timeout`` seconds (default ``WorkerOptions.drain_timeout``, 30 s), or on a
        KeyboardInterrupt or an asyncio cancellation of the task itself (the first Ctrl-C
        under ``asyncio.run``), the jobs still in flight are abandoned: a warning names
        them, their futures fail with ``WorkerClosed``, and the host pool is kept (not
        freed) since their copies may still write it. The task that opened the worker
        also leaves its task group here (``async with`` exit does so), so that task must
        call it outside any cancel scope it entered after opening.
        """
        lifecycle = self._lifecycle
        timeout = self._core.options.drain_timeout_or(drain_timeout)
        if lifecycle.state is State.NEW and self._loop_thread is None:  # never opened
            if lifecycle.begin_close() is State.NEW:
                self._core.close()
            return
        if threading.get_ident() != self._loop_thread:
            if lifecycle.closed.is_set():
                return  # closed already: nothing left on the opener's loop
            # Its poller, futures and doorbell belong to the opener's loop: a drain from
            # another thread's loop would resolve them off their loop.
            raise UsageError(
                "aclose() must run on the event loop thread that opened the worker; from another "
                "thread, hand it to that loop (e.g. anyio.from_thread.run with the loop's token)"
            )
        try:
            if lifecycle.begin_close() is State.OPEN:
                await self._drain_and_free(timeout)
            else:
                with anyio.CancelScope(shield=True):  # another task is closing: wait for it
                    while not lifecycle.closed.is_set():
                        await anyio.sleep(self._drain_nap())
        finally:
            await self._leave_task_group()  # also when the drain raised

    def _drain_nap(self) -> float:
        """How long a closing task sleeps between polls. The drain does not nap on the
        doorbell, so a long ``poll_interval`` would stretch every shutdown by up to that
        much (2 s for a job that ended after 50 ms, at ``poll_interval=2``)."""
        return min(self._core.options.poll_interval, _MAX_DRAIN_NAP)

    async def _drain_and_free(self, idle_timeout: float) -> None:
        escaped: list[BaseException] = []

        def collect() -> None:  # a done callback's exception waits until every job is resolved
            raised = self._resolve(self._core.poll())
            if raised is not None:
                escaped.append(raised)

        # Jobs end here or in the poller, which runs on while the drain naps (and, woken by
        # the doorbell, usually sees an end first): the core's idle clock counts both.
        drain = self._core.drain(idle_timeout, collect)
        try:
            with anyio.CancelScope(shield=True):
                while (wait := drain.next()) is not None:  # if a poll raises, the drain ends here
                    nap = self._drain_nap()
                    await anyio.sleep(nap if wait.timeout is None else min(nap, wait.timeout))
            if escaped:
                raise escaped[0]
        finally:
            self._free(drain.why)

    def _free(self, why: str) -> None:
        """Stop the poller, close the core (abandoning what never ended) and resolve the
        futures that are left; never waits for a copy."""
        abandoned: list[Job] = []
        escaped: list[BaseException] = []

        def resolve(jobs: list[Job]) -> None:  # before lanes and memory go: nothing is lost
            raised = self._resolve(jobs)
            if raised is not None:
                escaped.append(raised)

        try:
            try:
                if self._poller_scope is not None:
                    self._poller_scope.cancel()  # it stops at its next await
                if self._poller is not None:  # it must not watch the bell once closed
                    self._poller.release_bell()
            finally:
                _, abandoned = self._core.close(why, report=resolve)  # lanes let pending rings run
            if not abandoned:
                self._close_bell()  # not otherwise: an abandoned copy may still ring it
            if escaped:
                raise escaped[0]
        finally:
            room = self._room
            if room is not None:
                self._room = None
                room.set()

    async def _leave_task_group(self) -> None:
        """Only the opening task can leave the group (anyio scopes are per task); another
        closer leaves it to the opener's ``async with`` exit."""
        group = self._task_group
        if group is None or self._opener != anyio.get_current_task().id:
            return
        self._task_group = None
        await group.__aexit__(None, None, None)

    def _close_bell(self) -> None:
        if self._bell is not None:
            self._bell.close()

