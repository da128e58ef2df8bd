"""One direction's ordered lane on the device: a strategy's main stream, whose job end
events mark completion in order. Layerwise jobs run on the same main stream
(``layers.CudaLayerRun``).

Two ways to issue: on the native path (a ``program.Recorder``) the caller only plans: it
records the strategy's calls as a program and hands it to the lane's native issuer thread,
which makes every driver call without the GIL and arms the completion's doorbells
(program.py, "Issuing"); a tiny job on an idle lane runs at once instead. A layerwise load
is one such program too, and a store's push another. On the Python path the caller makes
the calls, or, with ``WorkerOptions.issue_thread``, a Python issuer thread makes those of
long jobs (and a layerwise load's later layers) after ``submit`` has returned."""

from __future__ import annotations

import functools
import time
from typing import Any

from ...layer_plan import CopySlice, LayerPlan
from ...plan import CopyPlan
from ...specs import Direction
from ..base import Completion, Lane, LaneStatistics, LayerRun
from .completion import CudaCompletion
from .driver import Driver, JobEvents
from .driver.codes import STICKY
from .issuer import Issuer
from .layers import CudaLayerRun
from .native import NativeIssuer, NativeWaiter
from .native_submit import NativeSubmit
from .planner import make_planner
from .program import Recorder
from .staged import StagedCopy
from .strategy import CopyContext, CopyStrategy

__all__ = ["ISSUE_THREAD_BYTES", "ISSUE_THREAD_KEEPS_GIL", "NATIVE_NUDGE_US", "CudaLane", "Dependency"]

# With ``WorkerOptions.issue_thread``, jobs of at least this many bytes
# are enqueued by the lane's issuer thread, so ``submit`` returns after planning; smaller
# ones, whose issue is short and whose latency a thread hand-off would add to, are enqueued
# by the caller when the lane is idle.
ISSUE_THREAD_BYTES = 8 << 20
# How long the native issuer thread looks for the next program before it sleeps: a submit
# right behind another is picked up without a wake-up.
NATIVE_SPIN_US = 20.0
# How long the native issuer thread spins once the lane's waiter rang a job's end: the
# loop wakes to that ring and often submits the lane's next job at once, which then finds
# the thread awake instead of paying for its futex wake-up (tens of microseconds on an idle
# CPU). At most this much spinning per ring, none while no job ends (docs/native.md, "The
# issuer").
NATIVE_NUDGE_US = 300.0
# An issuer thread keeps the GIL through its batched copies, so it takes the GIL once per
# job, not once per call: each retake waits for the loop thread or the other lanes' issuers
# to let go (beside a pure-Python thread, for a switch interval). Dropping it there made
# round trips beside a busy Python thread longer, and one issuer thread shared by the
# lanes did no better; even so the thread slows GEMMs launched from another Python thread
# more than issuing on the caller does, which is why ``issue_thread`` is off by default
# (docs/performance.md, "Issue thread").
ISSUE_THREAD_KEEPS_GIL = True


class Dependency:
    """What a copy waits for: a pooled event of ours (given back once the job is enqueued),
    recorded on the caller's ``stream`` (behind a wait on ``source``, a caller's event)
    when the job is launched. On the native path that record is a row of the job's one
    program; otherwise ``launch`` makes it on the submitting thread."""

    __slots__ = ("event", "source", "stream")

    def __init__(self, event: Any, stream: Any = None, source: Any = None) -> None:
        self.event = event
        self.stream = stream
        self.source = source

    @property
    def pending(self) -> bool:
        """Not recorded yet."""
        return self.stream is not None

    def resolve(self, driver: Any) -> None:
        """Record the event where the copy's dependency lies (a ``Recorder`` records the
        calls into the job's program)."""
        if self.stream is None:
            return
        if self.source is not None:
            driver.stream_wait(self.stream, self.source)
        driver.record(self.event, self.stream)
        self.stream = self.source = None


class CudaLane(NativeSubmit, Lane):
    """One direction: a main stream whose job end events mark completion, in order.

    With ``issue_thread``, jobs of ``ISSUE_THREAD_BYTES`` or more (and any job behind one)
    are enqueued by the lane's issuer thread: ``launch`` returns once the job is planned
    and its dependency captured.
    """

    def __init__(self, driver: Driver, direction: Direction, strategy: CopyStrategy, *,
                 issue_thread: bool = False, recorder: Recorder | None = None,
                 table: Any = None, measure_stalls: bool = False) -> None:
        """``recorder``: the strategy's stand-in driver, whose jobs become programs run by
        the lane's native issuer thread (needs ``table``); ``table``: the native helper's
        driver table, for the lane's waiter and issuer threads (None: the Python path, and
        host-function doorbells); ``issue_thread``: a Python issuer thread for long jobs
        (the Python path only: the native path has its own); ``measure_stalls``: layer
        gates time their consumer's wait on the device (``WorkerOptions.layer_stalls``)."""
        if recorder is not None and table is None:
            raise ValueError("a native lane (recorder) needs the helper's table for its threads")
        self.direction = direction
        self.measure_stalls = measure_stalls
        self._driver = driver
        self._strategy = strategy
        self.strategy_name: str = strategy.name
        self.stream = strategy.main_stream
        self._recorder = recorder
        self.waiter: NativeWaiter | None = None
        self.native: NativeIssuer | None = None
        self.planner: Any = None  # ``_native.Planner``: jobs planned in C from their ids
        self._staging_shared = False
        self.last_ticket: Any = None  # the native issuer's latest program of this lane
        # A Python issuer thread: ``issue_thread``, or one a layerwise load made for its
        # later layers (``layer_issuer``); the Python path only.
        self._issue_thread = issue_thread and recorder is None
        self._issuer = Issuer(f"aiokv-issue-{direction.value}") if self._issue_thread else None
        # Jobs the issuer thread enqueued, the host seconds it spent on them and its CPU
        # seconds doing so (the bench reports them beside the caller's submit time).
        self.issued_later = 0
        self.issue_seconds = 0.0
        self.issue_cpu_seconds = 0.0
        # Host clock just before the latest job's copies were handed to the device.
        self.last_started_at: float | None = None
        # The device slot of layerwise jobs whose blocks do not run, and the tables that
        # fold a job's layers from its ids (``layer_copies.layer_ops``).
        self.layer_staging: Any = None
        self.layer_folder: Any = None
        # Where completion doorbells wait on job end events (see Driver.ring_after).
        try:
            self.bell_stream = self._driver.create_stream()
        except BaseException:
            strategy.close()
            raise
        try:
            if table is not None:
                self.waiter = NativeWaiter(table, self.bell_stream)
            if recorder is not None:
                recorder.bind(self.stream, self._driver.create_event())
                self.native = NativeIssuer(table, self.waiter, STICKY, NATIVE_SPIN_US, NATIVE_NUDGE_US)
                recorder.attach(self.native)
                ctx = getattr(strategy, "ctx", None)
                pool = getattr(ctx, "pool", None)
                if pool is not None:
                    chunks = pool.tensor.numel() // ctx.layout.chunk_bytes  # type: ignore[union-attr]
                    self.planner = make_planner(strategy, ctx, self.native.handle, recorder.main,  # type: ignore[arg-type]
                                                recorder.rescue, chunks)
                    if self.planner is not None and isinstance(strategy, StagedCopy):
                        strategy.planner = self.planner
        except BaseException:
            if self.waiter is not None:
                self.waiter.close()
            self._driver.destroy_stream(self.bell_stream)
            strategy.close()
            raise

    def launch(self, plan: CopyPlan, dependency: Any) -> Completion:
        if self.native is not None:
            return self._submit(plan, dependency)
        drv = self._driver
        dep: Dependency | None = dependency
        events = None
        issuer = self._issuer
        defer = self._issue_thread and plan.total_bytes >= ISSUE_THREAD_BYTES
        try:
            drv.ensure_context()
            drv.check_usable()
            if dep is not None and dep.pending:
                dep.resolve(drv)
            events = drv.take_job_events()
        except BaseException:
            self._give_back(events, dep)
            raise
        completion = CudaCompletion(drv, events, None, self.bell_stream, issued_later=issuer is not None,
                                    waiter=self.waiter)
        work = functools.partial(self._issue, plan, dep, completion, events)
        if issuer is None:
            work()
            return completion
        ran = False

        def run_once() -> None:
            nonlocal ran
            ran = True  # from here on ``_issue`` owns the events, failures included
            work()

        try:
            issuer.run(run_once, defer)
        except BaseException:
            if not ran:  # closed since the core's check, or no thread to queue it on
                self._give_back(events, dep)
            raise
        return completion

    def _issue(self, plan: CopyPlan, dep: Dependency | None, completion: CudaCompletion,
               events: JobEvents) -> None:
        """Prepare and enqueue one job, on the caller's thread or the issuer's, never both
        at once (the strategies' state is theirs alone). On the caller's thread a failure
        before anything was enqueued, or a sticky one, raises; otherwise it is the job's,
        reported once what was enqueued is over."""
        drv = self._driver
        later = self._issuer is not None and self._issuer.on_own_thread()
        error: BaseException | None = None
        cpu = time.thread_time() if later else 0.0
        began = started = time.perf_counter()
        enqueuing = False
        hold_gil = True if later and ISSUE_THREAD_KEEPS_GIL else None
        try:
            drv.ensure_context()
            drv.check_usable()
            prepared = self._strategy.prepare(plan)
            started = time.perf_counter()  # the start event is recorded after this
            # The strategy records ``stop`` behind every copy: that is the job's end.
            enqueuing = True
            self._strategy.enqueue(prepared, dep.event if dep is not None else None, events.start,
                                   events.stop, hold_gil=hold_gil)
        except BaseException as exc:
            if not later and (not enqueuing or drv.broken is not None):
                self._give_back(events if drv.broken is None else None, dep)
                if drv.broken is not None and drv.broken is not exc:
                    raise drv.broken from exc
                raise
            if not later and not isinstance(exc, Exception):
                raise
            error = exc
            if drv.broken is None:
                try:
                    drv.record(events.done, self.stream)  # ends after the part enqueued
                except Exception:
                    # The event's last record is not this job's: wait out what was
                    # enqueued here, so the failure is not reported while copies still run.
                    try:
                        drv.stream_synchronize(self.stream)
                    except Exception:
                        pass  # a broken context fails every job anyway
        if dep is not None:
            drv.give_sync_event(dep.event)
        self.last_started_at = started
        completion.mark_issued(started, error)
        if later:
            self.issued_later += 1
            self.issue_seconds += time.perf_counter() - began
            self.issue_cpu_seconds += time.thread_time() - cpu

    # -- layerwise jobs (``layers.CudaLayerRun``) ------------------------------------------

    @property
    def driver(self) -> Driver:
        return self._driver

    @property
    def recorder(self) -> Recorder | None:
        return self._recorder

    @property
    def issuer(self) -> Issuer | None:
        return self._issuer

    def layer_issuer(self) -> Issuer:
        """The issuer a layerwise load hands its later layers to on the Python path: the
        lane's own, made on first use where ``issue_thread`` is off. Every launch after it
        then goes through it (at once, on the caller's thread, while it holds nothing), so
        the lane's jobs stay in submission order."""
        if self._issuer is None:
            self._issuer = Issuer(f"aiokv-issue-{self.direction.value}")
        return self._issuer

    @property
    def context(self) -> CopyContext:
        """The strategy's addresses of this lane's tensors and pool."""
        return self._strategy.ctx

    def pointers(self, plan: CopyPlan | CopySlice) -> tuple[Any, Any, Any]:
        """The plan's (dst, src, sizes) tables in this lane's direction."""
        return self._strategy.ctx.pointers(plan)

    def launch_layers(self, plan: LayerPlan, dependency: Any) -> LayerRun:
        drv = self._driver
        dep: Dependency | None = dependency
        issuer = self._issuer
        try:
            drv.ensure_context()
            drv.check_usable()
            if dep is not None and dep.pending:
                dep.resolve(drv)  # on the caller's thread, at submit (DESIGN.md section 1)
            run = CudaLayerRun(self, plan, store=False)
        except BaseException:
            self._give_back(None, dep)
            raise
        if self.native is not None:  # one program, behind every job the lane holds
            run.submit_load(dep)
            return run
        if issuer is None and run.head == run.num_layers:
            run.issue_load(dep, on_issuer=False)
            return run
        if issuer is None:  # made now, idle: the first layers still go at once, from here
            issuer = self.layer_issuer()
        ran = False

        def work() -> None:
            nonlocal ran
            ran = True  # from here on ``issue_load`` owns the events, failures included
            run.issue_load(dep, on_issuer=issuer.on_own_thread())

        try:
            issuer.run(work, defer=False)  # behind the jobs the issuer still holds
        except BaseException:
            if not ran:
                run.give_back()
                self._give_back(None, dep)
            raise
        return run

    def open_layers(self, plan: LayerPlan) -> LayerRun:
        self._driver.ensure_context()
        self._driver.check_usable()
        return CudaLayerRun(self, plan, store=True)

    def fix(self, dependency: Any) -> None:
        dep: Dependency | None = dependency
        if dep is not None and dep.pending:
            self._driver.ensure_context()
            dep.resolve(self._driver)

    def statistics(self) -> LaneStatistics:
        strategy = self._strategy
        issued_later, seconds, cpu = self.issued_later, self.issue_seconds, self.issue_cpu_seconds
        started = self.last_started_at
        lags: tuple[float, ...] = ()
        if self.native is not None:
            stats = self.native.stats()
            if "issued" in stats:
                issued_later = int(stats["issued"]) - int(stats["inline"])
                seconds, cpu = float(stats["busy_seconds"]), float(stats["cpu_seconds"])
            lags = tuple(self.native.lags())
            ticket = self.last_ticket
            if ticket is not None:  # a layerwise job since (``last_started_at``) may be later
                began = ticket.started_at
                began = ticket.queued_at if began is None else began  # not begun before that
                started = began if started is None else max(started, began)
        return LaneStatistics(
            strategy=self.strategy_name,
            pitched_jobs=strategy.pitched_jobs,
            pitched_heights=tuple(sorted({len(run.refs) for run in strategy.ctx.runs})),
            staged_jobs=strategy.staged_jobs,
            issued_later=issued_later,
            issue_seconds=seconds,
            issue_cpu_seconds=cpu,
            last_started_at=started,
            issue_lags=lags,
        )

    def _give_back(self, events: JobEvents | None, dep: Dependency | None) -> None:
        """Return a job's pooled events when nothing of it was enqueued."""
        if events is not None:
            self._driver.give_job_events(events)
        if dep is not None:
            self._driver.give_sync_event(dep.event)

    def abandon(self) -> None:
        """Dropped unclosed: keep what queued copies may still read, and let the issuer
        and waiter threads end after their queues."""
        self._strategy.abandon()
        if self.native is not None:
            self.native.abandon()
        if self.layer_staging is not None:
            self.layer_staging.abandon()
        if self.waiter is not None:
            self.waiter.abandon()
        if self._issuer is not None:
            self._issuer.stop()

    def close(self) -> None:
        # Pending rings run before the stream goes (the doorbell is closed after this). A
        # dead context runs no host functions: their FILEs and descriptors are leaked.
        if self._issuer is not None:
            self._issuer.close()
        if self.native is not None:
            self.native.close()  # what is queued is issued first (or, past its bound, cancelled)
        try:
            try:
                self._driver.stream_synchronize(self.bell_stream)
                # Every job's copies end on the main stream, also those of one that a
                # KeyboardInterrupt cut short mid-enqueue, which no job tracks.
                self._driver.stream_synchronize(self.stream)
            except Exception:
                pass
            if self.waiter is not None:  # its rings are over: the bell stream was synchronised
                try:
                    self._driver.ensure_context()
                    self.waiter.close()
                except Exception:
                    self.waiter.abandon()
            self._driver.destroy_stream(self.bell_stream)
        finally:
            try:
                if self.layer_staging is not None:  # its slot: the main stream was synchronised
                    self.layer_staging.close()
            finally:
                self._strategy.close()
