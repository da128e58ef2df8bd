"""One job's enqueue as a program of driver calls, run by one call into the native helper.

``Recorder`` stands in for ``Driver`` inside a lane's copy strategy. Between ``open`` and
``commit`` the strategy's enqueue calls (``record``, ``stream_wait``, ``memcpy``,
``memcpy_batch``, ``memcpy_batch_at``, ``memcpy_pitched``, ``launch``) become rows of a
``Program``; every other attribute, and any call outside a program, is the driver's.
``commit`` hands the rows to ``_native.Table.enqueue``: the job's whole enqueue is one
crossing out of Python, with no GIL hand-over between its driver calls. The strategies are
the same code on both paths, so the Python path (the driver called directly) and the
native one make the same calls in the same order (tests/test_cuda_native.py).

The C call's contract (``_native.c`` has it in full): ``enqueue(ops, buffers, main,
rescue, hold_gil)``; ``ops`` is rows of ``WORDS`` unsigned 64-bit words, opcode first:

==========  ===========================================================================
``WAIT``     stream, event: ``cuStreamWaitEvent(stream, event, 0)``
``RECORD``   event, stream: ``cuEventRecord``
``BATCH``    stream, dst, src, sizes, count, flags, first: ``cuMemcpyBatchAsync`` of copies
             ``[first, first + count)`` of three tables in ``buffers`` (8-byte ints);
             flags bit 0 stream-ordered, bit 1 to host
``COPY``     stream, dst, src, nbytes: ``cuMemcpyAsync``
``PITCHED``  stream, ops, count, first: ``cuMemcpy3DBatchAsync`` of ops ``[first, first +
             count)`` of a buffer of 14-word ops
``LAUNCH``   stream, function, grid, block, blob, offsets, nparams: ``cuLaunchKernel`` with
             ``params[i] = &blob[offsets[i]]``
==========  ===========================================================================

Every row is checked before the first call (bad input raises ``InvalidSpec``, nothing is
enqueued); a failing call stops the program and every stream it used is joined into
``main`` through the ``rescue`` event, so the lane's end event covers what was enqueued.

Issuing
-------
A lane on the native path has an issuer thread (``native.NativeIssuer``, a pthread in the
helper) that makes every driver call of its programs without the GIL. The contract other
parts build on:

- ``Recorder.submit(end=0, run_here=False) -> Ticket`` hands the open program to the
  lane's issuer and returns at once. The rows are checked first (bad input raises
  ``InvalidSpec``, nothing is queued) and copied, with every buffer they name, into C
  memory: the caller may reuse its arrays as soon as it returns. Programs run in the order
  they were submitted, behind every program of the lane submitted before. ``end``: an event
  the thread records on ``main`` behind what a failed program enqueued (its streams joined
  into ``main`` first), and the event doorbells asked for before the issue wait on.
- The ``Ticket`` (``_native.Ticket``): ``rows_done`` is how many rows the issuer has made so
  far (an atomic read of C memory: never blocks, any thread); ``wait_rows(n, timeout=None)``
  blocks, the GIL released, until ``rows_done >= n`` (False on timeout, or when the program
  ended short of ``n`` rows: a failure); ``wait(timeout=None)`` until it has been issued
  (a signal handler that raises interrupts either wait, as Ctrl-C does);
  ``result()`` is None until then, and afterwards ``(rows_done, cuda_result, failed_op,
  end_recorded)``: ``cuda_result`` 0, the CUresult of the row that failed (opcode
  ``failed_op``), or ``native.NativeIssuer.cancelled`` (the lane closed first, nothing ran);
  ``Recorder.error_of(result)`` turns it into the aiokv error the Python path raises.
  ``ring_fd(fd)`` has the thread arm a doorbell ring once the program is issued (False: it
  is issued already, arm it yourself). ``queued_at`` / ``started_at`` / ``finished_at``:
  CLOCK_MONOTONIC seconds (``time.perf_counter``'s clock on Linux).
- A layerwise load is one program of all its layers (``layer_program``), layer ``i``
  marked issued once ``rows_done`` passes the row of its record; with ``stamps=True``
  (``submit``'s seventh argument) ``Ticket.stamps()`` says when each row's call returned.
- ``Recorder.commit`` stays synchronous: on a lane with an issuer it submits and waits for
  the ticket (so it stays in order behind the lane's queued jobs), then raises as before.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import InvalidSpec, WorkerClosed

__all__ = [
    "CALL_NAMES", "NATIVE_GIL_HELD_US", "OP_BATCH", "OP_COPY", "OP_LAUNCH", "OP_PITCHED",
    "OP_RECORD", "OP_WAIT", "RUN_HERE_US", "WORDS", "Program", "Recorder", "batch_flags",
]

OP_WAIT, OP_RECORD, OP_BATCH, OP_COPY, OP_PITCHED, OP_LAUNCH = range(1, 7)
WORDS = 8
CALL_NAMES = {
    OP_WAIT: "cuStreamWaitEvent", OP_RECORD: "cuEventRecord", OP_BATCH: "cuMemcpyBatchAsync",
    OP_COPY: "cuMemcpyAsync", OP_PITCHED: "cuMemcpy3DBatchAsync", OP_LAUNCH: "cuLaunchKernel",
}
# A program whose driver calls should take longer than this (host microseconds, estimated
# below) releases the GIL once for the whole call instead of holding it: the staged and
# 2 MiB-page jobs hold it, a job of thousands of single-page descriptors does not
# (docs/native.md, "The call").
NATIVE_GIL_HELD_US = 200.0
_US_PER_CALL, _US_PER_DESCRIPTOR, _US_PER_PITCHED_OP = 1.5, 0.8, 3.0
# A program whose driver calls should take at most this long (a job of a few blocks: its
# record, one copy, its end) runs on the submitting thread when the lane's issuer is idle,
# holding the GIL: that costs about what handing it over does, and saves the thread's
# wake-up from the job's round trip (docs/native.md, "The issuer").
RUN_HERE_US = 8.0


def batch_flags(stream_ordered: bool = True, to_host: bool | None = None) -> int:
    """The BATCH row's flags word: which of the table's copy attributes the call takes."""
    return int(bool(stream_ordered)) | (2 if to_host else 0)


class Program:
    """Rows of driver calls and the buffers they name, built in order (see module doc)."""

    __slots__ = ("buffers", "cost", "ticket", "words")

    def __init__(self) -> None:
        self.words: list[int] = []
        self.buffers: list[Any] = []
        self.cost = 0.0  # estimated host microseconds of its driver calls
        self.ticket: Any = None  # its issuer's ticket, once submitted (``Recorder.submit``)

    @property
    def settled(self) -> bool:
        """Whether nothing of it can still reach the device later: issued, refused, or never
        submitted. A buffer its rows read may be rewritten then (``PieceKernel.upload``)."""
        ticket = self.ticket
        return ticket is None or ticket is _REFUSED or ticket.issued

    def __len__(self) -> int:
        return len(self.words) // WORDS

    def buffer(self, obj: Any) -> int:
        """Keep ``obj`` (a buffer) for the call; its index for rows to name."""
        self.buffers.append(obj)
        return len(self.buffers) - 1

    def wait(self, stream: Any, event: Any) -> None:
        self.words += (OP_WAIT, int(stream), int(event), 0, 0, 0, 0, 0)
        self.cost += _US_PER_CALL

    def record(self, event: Any, stream: Any) -> None:
        self.words += (OP_RECORD, int(event), int(stream), 0, 0, 0, 0, 0)
        self.cost += _US_PER_CALL

    def copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.words += (OP_COPY, int(stream), int(dst), int(src), int(nbytes), 0, 0, 0)
        self.cost += _US_PER_CALL

    def batch(self, dst: Any, src: Any, sizes: Any, stream: Any, flags: int, count: int,
              first: int = 0, *, ids: tuple[int, int, int] | None = None) -> None:
        """Copies ``[first, first + count)`` of the tables (8-byte ints); ``ids``: the
        tables are buffers of this program already."""
        d, s, n = ids if ids is not None else (self.buffer(dst), self.buffer(src), self.buffer(sizes))
        self.words += (OP_BATCH, int(stream), d, s, n, int(count), flags, int(first))
        self.cost += _US_PER_CALL + _US_PER_DESCRIPTOR * count

    def pitched(self, ops: np.ndarray, stream: Any) -> None:
        count = int(ops.shape[0])
        self.words += (OP_PITCHED, int(stream), self.buffer(ops), count, 0, 0, 0, 0)
        self.cost += _US_PER_CALL + _US_PER_PITCHED_OP * count

    def launch(self, function: Any, grid: int, block: int, stream: Any, blob: Any,
               offsets: np.ndarray) -> None:
        """``blob``: the parameters' bytes as laid out for the kernel; ``offsets``: where
        each parameter starts in it (8-byte ints)."""
        self.words += (OP_LAUNCH, int(stream), int(function), int(grid), int(block),
                       self.buffer(blob), self.buffer(offsets), int(offsets.shape[0]))
        self.cost += _US_PER_CALL

    def streams(self) -> list[int]:
        """Every stream a row names, in first-use order."""
        w = self.words
        seen = dict.fromkeys(w[i + 2] if w[i] == OP_RECORD else w[i + 1] for i in range(0, len(w), WORDS))
        return list(seen)


class Recorder:
    """A lane's stand-in for ``Driver``: records the strategy's enqueue calls while a
    program is open and runs them in one native call (see the module doc).

    ``main`` is the lane's main stream and ``rescue`` an event of the lane's: after a
    failure, every stream the job used is joined into ``main`` through it. ``fail``
    turns a driver code into the aiokv error (``Driver.fail``: a sticky code also marks
    the backend broken).
    """

    def __init__(self, driver: Any, table: Any, main: Any, rescue: Any,
                 fail: Callable[[int, str], Exception]) -> None:
        self._driver = driver
        self._table = table
        self._fail = fail
        self.main = int(main)
        self.rescue = int(rescue)
        self.program: Program | None = None
        self.issuer: Any = None  # the lane's ``native.NativeIssuer`` (``attach``), if any
        self._aborted: Any = None
        self.calls = 0  # native calls made: one per job
        self.ran = False  # the last commit reached the driver (so may have enqueued part)
        self.failed_row: int | None = None  # the row the last commit stopped at, if it failed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)

    def bind(self, main: Any, rescue: Any) -> None:
        """Set the lane's main stream and rescue event (known once the strategy exists)."""
        self.main, self.rescue = int(main), int(rescue)

    def attach(self, issuer: Any) -> None:
        """Run programs on the lane's issuer thread from now on (``submit``; ``commit`` too,
        waiting for it, so that every program stays in submission order)."""
        self.issuer = issuer

    # -- recording ------------------------------------------------------------------------

    def open(self) -> Program:
        """Start recording one job."""
        self.program = Program()
        return self.program

    def record(self, event: Any, stream: Any) -> None:
        if self.program is None:
            return self._driver.record(event, stream)
        self.program.record(event, stream)

    def stream_wait(self, stream: Any, event: Any) -> None:
        if self.program is None:
            return self._driver.stream_wait(stream, event)
        self.program.wait(stream, event)

    def memcpy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if self.program is None:
            return self._driver.memcpy(dst, src, nbytes, stream)
        self.program.copy(dst, src, nbytes, stream)

    def memcpy_batch(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: Any, *,
                     stream_ordered: bool = True, to_host: bool | None = None,
                     hold_gil: bool | None = None) -> None:
        if self.program is None:
            return self._driver.memcpy_batch(dst, src, sizes, stream, stream_ordered=stream_ordered,
                                             to_host=to_host, hold_gil=hold_gil)
        n = int(dst.shape[0])
        if n:
            self.program.batch(dst, src, sizes, stream, batch_flags(stream_ordered, to_host), n)

    def memcpy_batch_at(self, dst: int, src: int, sizes: int, n: int, stream: Any, *,
                        stream_ordered: bool = True, to_host: bool | None = None,
                        hold_gil: bool | None = None) -> None:
        """The driver reads the three tables during its call and the caller may rewrite
        them after it, so a recorded call copies them now."""
        if self.program is None:
            return self._driver.memcpy_batch_at(dst, src, sizes, n, stream, stream_ordered=stream_ordered,
                                                to_host=to_host, hold_gil=hold_gil)
        if n <= 0:
            return
        # ``string_at`` keeps the GIL (``memmove`` through ctypes drops it: beside a busy
        # Python thread each drop may cost a switch interval).
        dst_t, src_t, sizes_t = (np.frombuffer(ctypes.string_at(address, 8 * n), dtype=np.uint64)
                                 for address in (dst, src, sizes))
        self.program.batch(dst_t, src_t, sizes_t, stream, batch_flags(stream_ordered, to_host), n)

    def memcpy_pitched(self, ops: np.ndarray, stream: Any, *, hold_gil: bool | None = None) -> None:
        if self.program is None:
            return self._driver.memcpy_pitched(ops, stream, hold_gil=hold_gil)
        if ops.shape[0]:
            self.program.pitched(np.ascontiguousarray(ops, dtype=np.uint64), stream)

    def launch(self, function: Any, grid: tuple[int, int, int], block: int, stream: Any,
               params: Any, packed: tuple[Any, np.ndarray] | None = None) -> None:
        """``packed``: (the parameters' bytes, each one's offset in them); the driver reads
        the values at launch and the caller rewrites them after, so they are copied now."""
        if self.program is None:
            return self._driver.launch(function, grid, block, stream, params, packed=packed)
        if packed is None or grid[1:] != (1, 1):
            raise InvalidSpec("a launch recorded for the native helper needs a 1-D grid and its "
                              "parameters packed (blob, offsets)")
        blob, offsets = packed
        self.program.launch(function, grid[0], block, stream, bytes(blob), offsets)

    # -- running --------------------------------------------------------------------------

    def submit(self, end: Any = 0, run_here: bool = False) -> Any:
        """Hand the open program to the lane's issuer; its ``Ticket`` at once (module doc,
        "Issuing"). Raises ``InvalidSpec`` with nothing queued on bad rows. ``run_here``:
        a tiny program runs on this thread now if the issuer is idle."""
        program, self.program = self.program, None
        if program is None:
            raise InvalidSpec("no program is open to submit")
        try:
            ticket = self.issuer.submit(program.words, tuple(program.buffers), self.main, self.rescue,
                                        int(end), run_here)
        except BaseException:
            program.ticket = _REFUSED
            raise
        program.ticket = ticket
        self.calls += 1
        return ticket

    def error_of(self, result: tuple[int, int, int, bool]) -> Exception | None:
        """The aiokv error of a ticket's ``result()`` (None: every row ran), as the Python
        path raises it; a sticky code marks the backend broken (``fail``)."""
        code, op = int(result[1]), int(result[2])
        if not code:
            return None
        if self.issuer is not None and code == self.issuer.cancelled:
            return WorkerClosed("the worker closed before this job's copies were issued; none ran")
        return self._fail(code, CALL_NAMES.get(op, "a driver call"))

    def commit(self, hold_gil: bool | None = None) -> None:
        """Run the open program now, in one native call (or, on a lane with an issuer, on
        its thread, waiting for it). Raises ``InvalidSpec`` (nothing enqueued, ``ran``
        False) on bad input, or the translated driver error of the call that failed
        (``ran`` True: what came before it is enqueued, and joined into main)."""
        program = self.program
        self.ran = False
        self.failed_row = None
        if program is None or not program.words:
            self.program = None
            return
        if self.issuer is not None:
            ticket = self.submit()
            # Queued: it runs whatever happens to this wait (a signal handler may raise in
            # it), so the caller must not take its events back as never used.
            self.ran = True
            ticket.wait()
            result = ticket.result()
            error = self.error_of(result)
            if error is not None:
                self.failed_row = int(result[0])
                raise error
            return
        self.program = None
        if hold_gil is None:
            hold_gil = program.cost <= NATIVE_GIL_HELD_US
        done, code = self._table.enqueue(array("Q", program.words), tuple(program.buffers),
                                         self.main, self.rescue, hold_gil)
        self.ran = True
        self.calls += 1
        if code:
            self.failed_row = int(done)
            raise self._fail(int(code), CALL_NAMES.get(program.words[done * WORDS], "a driver call"))

    def abort(self) -> None:
        """The strategy raised while recording: enqueue what it recorded before (what the
        Python path would have enqueued) and join every stream it used into main, as the
        strategies' own cleanup does there. Driver errors here are dropped: the caller
        raises the strategy's error."""
        self.abort_later()
        ticket = self._aborted
        if ticket is not None:
            ticket.wait()

    def abort_later(self, end: Any = 0) -> Any:
        """``abort`` without waiting on a lane with an issuer: the ticket of what it queued
        (None where nothing was, or it ran at once). ``end`` is recorded on main behind it."""
        program, self.program = self.program, None
        self.ran = False
        self._aborted = None
        if program is None or (not program.words and not end):
            return None
        for stream in program.streams():
            if stream != self.main:
                program.record(self.rescue, stream)
                program.wait(self.main, self.rescue)
        if end:
            program.record(end, self.main)
        try:
            if self.issuer is not None:
                self.program = program
                self._aborted = self.submit()
            else:
                self._table.enqueue(array("Q", program.words), tuple(program.buffers), self.main,
                                    self.rescue, True)
        except Exception:
            self.program = None
        self.ran = True
        return self._aborted


_REFUSED: Any = object()  # ``Program.ticket`` of a program its issuer refused (never runs)
