"""Whether the native helper (``_native``, built from ``_native*.c`` at install time) is in
use, and why; and the thin Python side of its waiter and issuer threads.

Where the helper is built a CUDA worker uses it by default (``AIOKV_NATIVE=0`` or
``WorkerOptions(native=False)`` turn it off): each lane's jobs are planned in C and issued
by its native issuer thread. Where it was installed without a C compiler the CUDA backend
issues each job's driver calls from Python, with the same results (docs/native.md). It
needs no cuda-python: the driver facade hands it the driver's entry points as addresses.
The CPU backend makes no driver calls, so it never uses the helper.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from ...errors import InvalidSpec, WorkerClosed

__all__ = ["ENV", "NativeIssuer", "NativeWaiter", "env_choice", "helper", "status"]

ENV = "AIOKV_NATIVE"
# The contract of the rows and calls this Python side speaks; ``_native.c`` exports its own
# (``ABI``): raise both together whenever an opcode, a row's words or a call changes.
_ABI, _WORDS = 4, 8

try:
    _ext: Any = importlib.import_module(f"{__package__}._native")
except ImportError as exc:  # not built (no compiler at install), or built for another Python
    _ext = None
    missing = isinstance(exc, ModuleNotFoundError) and exc.name == f"{__package__}._native"
    _WHY = "not built" if missing else f"failed to load ({exc})"
else:
    if (getattr(_ext, "ABI", None), getattr(_ext, "WORDS", None)) != (_ABI, _WORDS):
        # An in-place build left from older sources (an editable install after a pull).
        _WHY = (f"built from other sources (ABI {getattr(_ext, 'ABI', None)}, this aiokv speaks "
                f"{_ABI}): rebuild it (python3 setup.py build_ext --inplace, or reinstall)")
        _ext = None
    else:
        _ext.set_error_class(InvalidSpec, WorkerClosed)
        _WHY = "built"


def helper() -> Any:
    """The loaded extension module, or None where it is not built or failed to load."""
    return _ext


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_choice() -> bool | None:
    """What ``AIOKV_NATIVE`` asks for: True, False, or None where it is unset or empty.
    Any other value raises ``InvalidSpec``: a typo must not silently pick a path."""
    raw = os.environ.get(ENV)
    value = (raw or "").strip().lower()
    if not value:
        return None
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise InvalidSpec(f"{ENV}={raw!r} is not understood: set it to 1 (use the native helper) or 0 "
                      "(issue from Python), or unset it (native where built)")


def status(requested: bool | None = None) -> tuple[bool, str]:
    """(whether a CUDA worker uses the native path, why), for ``requested`` as in
    ``WorkerOptions.native``: None follows ``AIOKV_NATIVE``, and with it unset takes the
    native path where the helper is built. Raises ``InvalidSpec`` for a value of
    ``AIOKV_NATIVE`` it does not understand."""
    if requested is False:
        return False, "disabled by WorkerOptions(native=False)"
    env = env_choice() if requested is None else None
    if env is False:
        return False, f"disabled by {ENV}={os.environ[ENV]}"
    if _ext is None:
        return False, f"native helper {_WHY}"
    if requested:
        return True, "native helper built; WorkerOptions(native=True)"
    if env:
        return True, f"native helper built; {ENV}={os.environ[ENV]}"
    return True, "native helper built; the default where it is"


class NativeWaiter:
    """One lane's waiter thread (``_native.Waiter``): rings a doorbell when a job's end
    event completes, with no Python thread involved. ``watch`` never blocks."""

    def __init__(self, table: Any, stream: Any, slots: int = 64) -> None:
        if _ext is None:
            raise InvalidSpec(f"the native helper is {_WHY}")
        self._waiter = _ext.Waiter(table, int(stream), slots)

    def watch(self, event: Any, fd: int) -> int:
        """0: armed; -1: cannot arm now (closed, or every slot busy); else the CUresult of
        the driver call that failed (nothing armed)."""
        return int(self._waiter.watch(int(event), fd))

    def stats(self) -> dict[str, Any]:
        return dict(self._waiter.stats())

    def close(self) -> None:
        self._waiter.close()

    def abandon(self) -> None:
        self._waiter.abandon()


class NativeIssuer:
    """One lane's issuer thread (``_native.Issuer``): runs the programs handed to it in
    order, without the GIL, and arms the doorbells asked for meanwhile through the lane's
    waiter. ``submit`` never waits for a driver call (program.py, "Issuing")."""

    def __init__(self, table: Any, waiter: NativeWaiter | None = None, sticky: Any = (),
                 spin_us: float = 0.0, nudge_us: float = 0.0) -> None:
        """``spin_us``: how long the thread looks for a next program after each before it
        sleeps; ``nudge_us``: how long it spins once ``waiter`` rings a job's end (or
        ``nudge`` is called), so a submit that the completion leads to finds it awake."""
        if _ext is None:
            raise InvalidSpec(f"the native helper is {_WHY}")
        self.cancelled = int(_ext.CANCELLED)
        self._issuer = _ext.Issuer(table, waiter._waiter if waiter is not None else None,
                                   tuple(int(c) for c in sticky), float(spin_us), float(nudge_us))
        self.submit = self._issuer.submit  # (ops, buffers, main, rescue, end, run_here, stamps) -> Ticket

    @property
    def handle(self) -> Any:
        """The ``_native.Issuer`` itself (what a ``_native.Planner`` queues on)."""
        return self._issuer

    def pause(self) -> None:
        """Pick up no program until ``resume`` (tests that need a job to stay queued)."""
        self._issuer.pause()

    def resume(self) -> None:
        self._issuer.resume()

    @property
    def idle(self) -> bool:
        """Nothing queued or running, nor paused: a program handed over now starts at once
        (never waits)."""
        return bool(self._issuer.idle)

    def drain(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or running; False if ``timeout`` passed first."""
        return bool(self._issuer.drain(timeout))

    def nudge(self) -> None:
        """Wake the thread into its ``nudge_us`` spin (what the waiter does as a job ends)."""
        self._issuer.nudge()

    def set_broken(self, code: int) -> None:
        """A sticky error seen elsewhere: every program not yet run fails with it, uncalled."""
        self._issuer.set_broken(int(code))

    def stats(self) -> dict[str, Any]:
        return dict(self._issuer.stats())

    def lags(self, pickup: bool = False) -> list[float]:
        """Seconds from each recent submit's return to the thread's first driver call for it;
        ``pickup``: from the later of that return and the previous program's end (the wait
        behind its calls left out: the thread's own wake-up or spin alone)."""
        return list(self._issuer.lags(pickup))

    def close(self, timeout: float = 10.0) -> bool:
        """Issue what is queued (for at most ``timeout`` seconds, then cancel the rest) and
        join the thread; False if it did not end (left to end by itself)."""
        return bool(self._issuer.close(timeout))

    def abandon(self) -> None:
        self._issuer.abandon()
