"""``AsyncOffloadingWorker``: submit returns at once with an awaitable future."""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.abc

from .core import OffloadCore, WorkerStatistics
from .doorbell import Doorbell
from .errors import DuplicateJob, InvalidSpec, WorkerClosed
from .future import TransferFuture
from .handler import Job
from .layout import CanonicalKVCaches
from .options import WorkerOptions
from .poller import Poller
from .specs import Direction, check_job_id

__all__ = ["AsyncOffloadingWorker"]

_MAX_DRAIN_NAP = 1e-3


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class AsyncOffloadingWorker:
    """Moves KV blocks between device memory and a host pool; every transfer is awaitable.

    Use as ``async with AsyncOffloadingWorker(kv, num_cpu_chunks=...) as worker:``. The
    context starts one poller task on the current event loop (asyncio, uvloop or trio) and,
    on exit, waits for every job in flight before it frees host memory.

    Args:
        kv_caches: the KV cache to serve (``CanonicalKVCaches.from_tensors(...)``, or an
            engine's object with the same fields, such as vLLM's).
        num_cpu_chunks: host pool size in chunks (pass this or ``cpu_bytes``).
        cpu_bytes: host pool size in bytes, rounded down to whole chunks.
        blocks_per_chunk: consecutive GPU blocks one host chunk holds.
        backend: ``"auto"`` (where the tensors live), ``"cuda"`` or ``"cpu"``.
        strategy: CUDA copy strategy, ``"auto" | "dma" | "kernel" | "staged"``.
        options: further knobs, a ``WorkerOptions`` or a dict.
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
        opts = WorkerOptions.coerce(options)
        if strategy is not None:
            opts = WorkerOptions(**{**opts.__dict__, "strategy": strategy})
        self._core = OffloadCore(
            kv_caches,
            num_cpu_chunks=num_cpu_chunks,
            cpu_bytes=cpu_bytes,
            blocks_per_chunk=blocks_per_chunk,
            backend=backend,
            options=opts,
        )
        self._state = _State.NEW
        self._futures: dict[int, TransferFuture] = {}
        self._poller: Poller | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        # The poller runs in its own scope, so any task can stop it without cancelling the
        # opener's body (which runs inside the task group's scope).
        self._poller_scope: anyio.CancelScope | None = None
        self._opener: int | None = None  # the task that entered the task group
        self._bell: Doorbell | None = None
        self._loop_thread: int | None = None
        self._closed = threading.Event()

    # -- facts --------------------------------------------------------------------------

    @property
    def num_cpu_chunks(self) -> int:
        """Chunks in the host pool (chunk ids must be below this)."""
        return self._core.num_cpu_chunks

    @property
    def blocks_per_chunk(self) -> int:
        """GPU blocks each host chunk holds."""
        return self._core.layout.blocks_per_chunk

    @property
    def num_gpu_blocks(self) -> int:
        """GPU blocks addressable in every group (block ids must be below this)."""
        return min(self._core.layout.num_gpu_blocks)

    @property
    def num_groups(self) -> int:
        """KV-cache groups in the layout (hybrid models have several; specs then need
        ``group_sizes``)."""
        return self._core.layout.num_groups

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one host chunk: ``blocks_per_chunk`` blocks of every KV tensor."""
        return self._core.layout.chunk_bytes

    @property
    def backend(self) -> str:
        """The backend copies run on: "cpu" or "cuda"."""
        return self._core.backend.name

    @property
    def host_pool(self) -> Any:
        """The host pool as one flat uint8 tensor (for inspection and tests)."""
        return self._core.pool.tensor

    def statistics(self) -> WorkerStatistics:
        """A snapshot: jobs in flight, completed and failed, and bytes moved, per direction."""
        return self._core.statistics()

    def __repr__(self) -> str:
        return (
            f"<AsyncOffloadingWorker {self._state.value} backend={self.backend} "
            f"chunks={self.num_cpu_chunks} in_flight: {self._core.describe_in_flight()}>"
        )

    # -- submitting ---------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any, *, after: Any = None) -> TransferFuture:
        """Enqueue a GPU -> host copy and return its future at once."""
        return self._submit(Direction.STORE, job_id, src_spec, dst_spec, after)

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, *, expedited: bool = False, after: Any = None
    ) -> TransferFuture:
        """Enqueue a host -> GPU copy; ``expedited`` loads never wait behind ordinary ones."""
        return self._submit(Direction.of_load(expedited), job_id, src_spec, dst_spec, after)

    def _submit(self, direction: Direction, job_id: int, src: Any, dst: Any, after: Any) -> TransferFuture:
        self.check_submittable()
        check_job_id(job_id)  # before it is looked up: a list would raise TypeError there
        if job_id in self._futures:
            if self._core.holds(job_id):
                raise DuplicateJob(f"job {job_id} is still in flight; use a new id")
            # Finished in this poll (a done callback of another job runs first).
            raise DuplicateJob(f"job {job_id} finished but its future is not resolved yet; reuse it after")
        job = self._core.submit(direction, job_id, src, dst, after)
        future = TransferFuture(job.job_id)
        self._futures[job.job_id] = future
        assert self._poller is not None
        self._poller.wake()
        return future

    def check_submittable(self, after: Any = None) -> None:
        """Raise what ``submit_*`` would raise for this worker's state, the calling thread,
        or ``after`` (checked without recording anything)."""
        if self._state is not _State.OPEN:
            raise WorkerClosed(
                "the worker is closed; create a new one"
                if self._state is _State.CLOSED
                else "the worker is not open yet: use `async with worker:` before submitting"
            )
        if threading.get_ident() != self._loop_thread:
            raise InvalidSpec(
                "submit_* must be called on the event loop thread that opened the worker; "
                "engine threads use SyncOffloadingWorker"
            )
        self._core.check_healthy()
        if after is not None:
            self._core.backend.check_after(after)

    def _complete_finished(self) -> int:
        done = self._core.poll()
        if not done:
            return 0
        escaped = self._resolve(done)
        if escaped is not None:
            raise escaped
        return len(done)

    def _resolve(self, done: list[Job]) -> BaseException | None:
        """Resolve every popped job's future (the core has forgotten them already), even if
        a done callback raises a BaseException (Exceptions are logged by the future); the
        first such exception is returned."""
        escaped: BaseException | None = None
        for job in done:
            assert job.result is not None
            future = self._futures.pop(job.job_id)
            try:
                future._resolve(job.result, job.error)
            except BaseException as exc:
                escaped = escaped or exc
        return escaped

    def _arm_heads(self) -> bool:
        """Have each direction's oldest job ring the doorbell as it ends; False if one cannot."""
        bell = self._bell
        assert bell is not None
        armed = True
        for job in self._core.heads():
            if job.bell_armed is False:  # asked once: None means it cannot ring
                job.bell_armed = True if job.completion.ring_when_done(bell) else None
            armed = armed and job.bell_armed is True
        return armed

    # -- lifetime -----------------------------------------------------------------------

    async def __aenter__(self) -> AsyncOffloadingWorker:
        if self._state is _State.OPEN:
            raise RuntimeError("this worker is already open; enter it once")
        if self._state is _State.CLOSED:
            raise WorkerClosed("this worker was closed; create a new one")
        opts = self._core.options
        self._bell = Doorbell() if opts.doorbell and Doorbell.supported() else None
        self._poller = Poller(
            self._complete_finished,
            lambda: len(self._futures),
            expected_wait=self._core.expected_wait,
            settle=self._core.settle,
            bell=self._bell,
            arm=self._arm_heads if self._bell is not None else None,
            spin_seconds=opts.spin_seconds,
            poll_interval=opts.poll_interval,
        )
        self._task_group = anyio.create_task_group()
        try:
            await self._task_group.__aenter__()
        except BaseException:
            self._close_bell()
            raise
        self._poller_scope = anyio.CancelScope()
        self._task_group.start_soon(self._run_poller, self._poller, self._poller_scope)
        self._opener = anyio.get_current_task().id
        self._loop_thread = threading.get_ident()
        self._state = _State.OPEN
        return self

    @staticmethod
    async def _run_poller(poller: Poller, scope: anyio.CancelScope) -> None:
        with scope:
            if not scope.cancel_called:  # closed before it ever ran: the bell is gone
                await poller.run()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Wait for every job in flight, stop the poller and free host memory. Idempotent.

        Any task on the opener's loop may call it (another thread must hand it to that
        loop: it raises ``InvalidSpec`` there unless closed already); the drain is
        shielded, so cancelling the closing task does not abandon copies that still write
        host memory. The task that opened the worker also leaves its task group here
        (``async with`` exit does so), so that task must call it outside any cancel scope
        it entered after opening.
        """
        if self._state is _State.NEW:
            self._state = _State.CLOSED
            self._core.close()
            self._closed.set()
            return
        if self._state is _State.OPEN and self._task_group is None:
            raise RuntimeError("a SyncOffloadingWorker owns this worker: call its shutdown() instead")
        if threading.get_ident() != self._loop_thread:
            if self._closed.is_set():
                return  # closed already: nothing left on the opener's loop
            # Its poller, futures and doorbell belong to the opener's loop: a drain from
            # another thread's loop would resolve them off their loop.
            raise InvalidSpec(
                "aclose() must run on the event loop thread that opened the worker; from another "
                "thread, hand it to that loop (e.g. anyio.from_thread.run with the loop's token)"
            )
        try:
            if self._state is _State.CLOSED:
                with anyio.CancelScope(shield=True):  # another task is closing: wait for it
                    while not self._closed.is_set():
                        await anyio.sleep(self._drain_nap())
            else:
                self._state = _State.CLOSED  # no new submits while draining
                await self._drain_and_free()
        finally:
            await self._leave_task_group()  # also when the drain raised

    def _drain_nap(self) -> float:
        """How long a closing task sleeps between polls. The drain does not nap on the
        doorbell, so a long ``poll_interval`` would stretch every shutdown by up to that
        much (2 s for a job that ended after 50 ms, at ``poll_interval=2``)."""
        return min(self._core.options.poll_interval, _MAX_DRAIN_NAP)

    async def _drain_and_free(self) -> None:
        escaped: BaseException | None = None
        try:
            with anyio.CancelScope(shield=True):
                while self._futures:
                    done = self._core.poll()  # if this raises, the drain ends here
                    # A done callback's exception waits until every job is resolved.
                    raised = self._resolve(done)
                    escaped = escaped or raised
                    if not done:
                        await anyio.sleep(self._drain_nap())
            if escaped is not None:
                raise escaped
        finally:
            try:
                try:
                    if self._poller_scope is not None:
                        self._poller_scope.cancel()  # it stops at its next await
                    if self._poller is not None:  # it must not watch the bell once closed
                        self._poller.release_bell()
                finally:
                    self._core.close()  # lanes let pending rings run before they go
                self._close_bell()  # not if that failed: a lane may still ring it
            finally:
                self._closed.set()

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
