"""The native path's submit, for ``lane.CudaLane``: the caller only plans.

``submit_*`` captures the copy's dependency on the caller's stream, on the caller's thread
(DESIGN.md section 1), plans the job (in C from its ids where the lane has a planner, else
by recording the strategy's calls) and hands the program to the lane's native issuer
thread, which makes every driver call without the GIL. A tiny program on an idle lane runs
at once instead. Layerwise loads and pushes go to the same issuer as programs of their own
(``layer_issue``, ``layer_pushes``), so the lane's jobs stay in submission order.
"""

from __future__ import annotations

from typing import Any

from ...plan import CopyPlan, IdPlan
from ..base import Completion
from .completion import CudaCompletion
from .driver import Driver, JobEvents
from .layer_copies import Dependency
from .native import NativeIssuer
from .program import CALL_NAMES, RUN_HERE_US, Recorder
from .staged import StagedCopy
from .strategy import CopyStrategy

__all__ = ["NativeSubmit"]


class NativeSubmit:
    """``CudaLane``'s native submit (a mixin: the state is the lane's)."""

    _driver: Driver
    _recorder: Recorder | None
    _strategy: CopyStrategy
    native: NativeIssuer | None
    planner: Any
    bell_stream: Any
    waiter: Any
    stream: Any
    last_ticket: Any
    _staging_shared: bool

    def _give_back(self, events: JobEvents | None, dep: Dependency | None) -> None:
        raise NotImplementedError

    def _submit(self, plan: CopyPlan, dependency: Any) -> Completion:
        """Plan the job and queue its program; raises only before anything was queued (the
        job's events and dependency given back), a failure after that is the job's."""
        drv = self._driver
        dep: Dependency | None = dependency
        events = None
        queued: list[Any] = []
        try:
            drv.ensure_context()
            drv.check_usable()
            events = drv.take_job_events()
            ticket, error = self._enqueue(plan, dep, events, queued)
        except BaseException as exc:
            if not queued:  # nothing queued: the job's events are ours again
                self._give_back(events if drv.broken is None else None, dep)
            if drv.broken is not None and drv.broken is not exc:
                raise drv.broken from exc
            raise
        self.last_ticket = ticket
        return CudaCompletion(drv, events, error, self.bell_stream, waiter=self.waiter, ticket=ticket,
                              recorder=self._recorder, dependency=dep.event if dep is not None else None,
                              stream=self.stream)

    def _enqueue(self, plan: CopyPlan, dep: Dependency | None, events: JobEvents,
                 queued: list[Any]) -> tuple[Any, BaseException | None]:
        """Queue the job's program: (its ticket, the job's error if the strategy failed
        while it was recorded). ``queued`` gets the ticket as soon as one exists: a raise
        with it empty means nothing of the job reached the issuer."""
        drv, rec = self._driver, self._recorder
        assert rec is not None and self.native is not None
        if self.planner is not None and type(plan) is IdPlan:
            ticket = self._plan_in_c(plan, dep, events)
            if ticket is not None:
                queued.append(ticket)
                return ticket, None
        if type(plan) is IdPlan:
            plan.check()  # bad input raises before the dependency is recorded
        if dep is not None and dep.pending:
            dep.resolve(drv)  # on the caller's thread, at submit (DESIGN.md section 1)
        prepared = self._strategy.prepare(plan)
        program = rec.open()
        error: BaseException | None = None
        try:
            dep_event = dep.event if dep is not None else None
            self._strategy.enqueue(prepared, dep_event, events.start, events.stop)
        except BaseException as exc:
            if drv.broken is not None:
                rec.program = None
                raise
            # What was recorded goes, joined into main with the job's end behind it, as the
            # Python path would have enqueued it; the job then fails, unraised.
            ticket = rec.abort_later(events.stop)
            if ticket is not None:
                queued.append(ticket)
            if ticket is None or not isinstance(exc, Exception):
                raise
            error = exc
        else:
            ticket = rec.submit(events.stop, program.cost <= RUN_HERE_US)
            queued.append(ticket)
        if self.planner is not None:
            self._share_staging()
        return ticket, error

    def _plan_in_c(self, plan: IdPlan, dep: Dependency | None, events: JobEvents) -> Any:
        """The job's program built and queued by the planner, with the dependency recorded
        on the caller's stream first, here: its ticket, or None where it plans in Python
        (nothing was done then). A failing dependency call raises, nothing queued."""
        planner = self.planner
        # Handles as ints: cuda-python's objects convert, whatever their version.
        start, stop = int(events.start), int(events.stop)
        if dep is None:
            out = planner.submit(plan.block_ids, plan.chunk_ids, start, stop)
        elif dep.pending:
            source = int(dep.source) if dep.source is not None else 0
            out = planner.submit(plan.block_ids, plan.chunk_ids, start, stop, int(dep.event), int(dep.stream),
                                 source, True)
        else:
            out = planner.submit(plan.block_ids, plan.chunk_ids, start, stop, int(dep.event))
        if type(out) is tuple:
            raise self._driver.fail(int(out[0]), CALL_NAMES.get(int(out[1]), "a driver call"))
        if out is not None and dep is not None:
            dep.stream = dep.source = None  # recorded
        return out

    def _share_staging(self) -> None:
        """Tell the planner of the ring once a job planned in Python made it (or found it
        could not be had), so that staged jobs plan in C from then on."""
        strategy = self._strategy
        if isinstance(strategy, StagedCopy) and not self._staging_shared:
            if strategy.slot_bytes == 0:
                self.planner.set_staging(0, 0, 0)
                self._staging_shared = True
            elif strategy.staging is not None and strategy.page_table is not None:
                ring = strategy.staging.data_ptr()
                self.planner.set_staging(ring, strategy.slot_bytes, strategy.page_table)
                self._staging_shared = True
