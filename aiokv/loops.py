"""Which event loop runs the calling task, and that loop's own cheap primitives.

anyio's portable primitives look the running loop up on every use, which costs
microseconds on paths taken once per job (each await of a future, each turn of the
poller); these pick the loop's own primitive where the loop is known, anyio's elsewhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio
import anyio.lowlevel

try:
    import sniffio as _sniffio
except ImportError:  # anyio no longer needs it; trio does, so it is here whenever trio is
    _sniffio = None  # type: ignore[assignment]

__all__ = ["LoopEvent", "loop_event", "loop_library", "loop_yield"]


class LoopEvent(Protocol):
    """What the poller and futures use of an event (``asyncio.Event`` or ``anyio.Event``)."""

    def is_set(self) -> bool: ...
    def set(self) -> None: ...
    async def wait(self) -> Any: ...


def loop_library() -> str | None:
    """"asyncio" (uvloop included), "trio", or None outside a loop we can name.

    Asked of the calling task, not of the thread: trio can run as a guest on an asyncio
    loop (and trio-asyncio mixes both), so a running asyncio loop does not mean the caller
    is an asyncio task. sniffio says which.
    """
    if _sniffio is not None:
        try:
            return _sniffio.current_async_library()
        except _sniffio.AsyncLibraryNotFoundError:
            pass  # no loop, or one sniffio cannot name
    try:
        asyncio.get_running_loop()
        return "asyncio"
    except RuntimeError:
        return None


def loop_yield() -> Callable[[], Awaitable[None]]:
    """The running loop's own zero-length yield. ``anyio.lowlevel.checkpoint`` looks the
    loop up on every call, which makes it two to three times dearer on asyncio than
    ``asyncio.sleep(0)`` on a path taken once per poll (docs/performance.md, "Completion")."""
    library = loop_library()
    if library == "asyncio":
        return lambda: asyncio.sleep(0)
    if library == "trio":
        import trio.lowlevel

        return trio.lowlevel.checkpoint
    return anyio.lowlevel.checkpoint


def loop_event() -> LoopEvent:
    """A fresh event for the calling task's loop: asyncio's own on asyncio and uvloop,
    anyio's elsewhere (trio). One is made on each await of a future and each poller turn
    after a submit; ``anyio.Event()`` looks up the loop and then anyio's backend every
    time, this only the loop."""
    if loop_library() == "asyncio":
        return asyncio.Event()
    return anyio.Event()
