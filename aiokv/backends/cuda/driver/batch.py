"""Batched copies through the driver: one call enqueues a whole job's descriptors.

cuda-python's own wrappers convert Python lists entry by entry; the entry points here are
bound through ctypes once and take numpy arrays (or a caller's pointer tables) as they are,
with or without dropping the GIL as each call's cost asks (docs/performance.md, "GIL").
``Driver`` mixes these in; they need only its ``fail`` translation and the entry points it
binds at start.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from ....errors import CudaCallFailed
from .codes import OK

__all__ = ["GIL_HELD_DESCRIPTORS", "GIL_HELD_PITCHED_OPS", "BatchCopies", "holding_gil"]

# Batches this small return almost as soon as a record does, so they keep the GIL as a record
# does. Larger ones drop it: held through the long calls of 2 MiB-page and pitched jobs, it
# slowed a GEMM loop in another Python thread (docs/performance.md, "GIL"). A caller may
# decide otherwise per call (``hold_gil``).
GIL_HELD_DESCRIPTORS = 16
GIL_HELD_PITCHED_OPS = 4


@functools.cache
def _pointer_operand() -> int:
    """``CU_MEMCPY_OPERAND_TYPE_POINTER`` (read once: cuda-python's enums cost microseconds)."""
    return int(cu.CUmemcpy3DOperandType.CU_MEMCPY_OPERAND_TYPE_POINTER)


@functools.cache
def _access_orders() -> tuple[int, int]:
    """The stream-ordered and any-order ``CUmemcpySrcAccessOrder`` values."""
    order = cu.CUmemcpySrcAccessOrder
    return int(order.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM), int(order.CU_MEMCPY_SRC_ACCESS_ORDER_ANY)


def holding_gil(fn: Any) -> Any:
    """The same ctypes entry point, called without dropping the GIL (None stays None)."""
    if fn is None:
        return None
    proto = ctypes.PYFUNCTYPE(fn._restype_, *fn._argtypes_)
    return proto(int(ctypes.cast(fn, ctypes.c_void_p).value or 0))


class BatchCopies:
    """The batched and pitched copy calls of ``Driver`` (a mixin: the state is the driver's)."""

    use_location_hints: bool = False
    device_index: int
    driver_version: int
    batch_kind: str
    _batch_fn: Any
    _batch_fn_gil: Any
    _batch3d_fn: Any
    _batch3d_fn_gil: Any
    _attrs: dict[tuple[bool, bool | None], Any]
    _attr_ptrs: dict[tuple[bool, bool | None], int]
    _first_attr_at: int
    _fail_idx_at: int

    def fail(self, code: int, what: str) -> Exception:
        raise NotImplementedError

    def _load_batch(self) -> tuple[Any, str]:
        """Bind cuMemcpyBatchAsync for raw pointer arrays (this binding drops the GIL).

        cuda-python's own wrapper converts Python lists entry by entry, at a cost per page,
        and holds the GIL; numpy arrays go in as they are here.
        """
        if self.driver_version < 12080 or not hasattr(cu, "CUmemcpyAttributes"):
            return None, "loop"  # an old driver, or bindings older than 12.8 (no attribute type)
        version = 13000 if self.driver_version >= 13000 else 12080
        flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
        try:
            ret = cu.cuGetProcAddress(b"cuMemcpyBatchAsync", version, flags)
        except Exception:
            return None, "loop"
        if ret[0] != OK or not int(ret[1]):
            return None, "loop"
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        if version >= 13000:
            proto = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, vp, sz, vp, vp, sz, vp)
            return proto(int(ret[1])), "batch13"
        proto = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, vp, sz, vp, vp, sz, vp, vp)
        return proto(int(ret[1])), "batch12"

    def _load_proc(self, name: bytes, proto: Any) -> Any:
        """A driver entry point bound through ctypes, or None where it cannot be found."""
        flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
        try:
            ret = cu.cuGetProcAddress(name, 12000, flags)
        except Exception:
            return None
        if ret[0] != OK or not int(ret[1]):
            return None
        return proto(int(ret[1]))

    def _load_batch3d(self) -> Any:
        """Bind cuMemcpy3DBatchAsync (CUDA >= 12.8) for pitched copies, or None."""
        if self.batch_kind == "loop" or not hasattr(cu, "CUmemcpy3DOperandType"):
            return None
        version = 13000 if self.batch_kind == "batch13" else 12080
        flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
        try:
            ret = cu.cuGetProcAddress(b"cuMemcpy3DBatchAsync", version, flags)
        except Exception:
            return None
        if ret[0] != OK or not int(ret[1]):
            return None
        vp, sz, ull = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_ulonglong
        if version >= 13000:
            return ctypes.CFUNCTYPE(ctypes.c_int, sz, vp, ull, vp)(int(ret[1]))
        return ctypes.CFUNCTYPE(ctypes.c_int, sz, vp, vp, ull, vp)(int(ret[1]))

    @property
    def pitched_copies(self) -> bool:
        """Whether ``memcpy_pitched`` can issue a whole batch of 2D copies in one call."""
        return self._batch3d_fn is not None

    @staticmethod
    def pitched_ops(
        dst: np.ndarray, dst_pitch: np.ndarray, src: np.ndarray, src_pitch: np.ndarray,
        width: np.ndarray, height: np.ndarray, *, stream_ordered: bool = True,
    ) -> np.ndarray:
        """Pack 2D copies as ``CUDA_MEMCPY3D_BATCH_OP`` rows (14 x uint64 = 112 bytes each).

        Pointer operands with 1-byte elements: ``rowLength`` is the pitch in bytes and the
        extent is (width bytes, height rows, depth 1). Layout checked against
        cuda-bindings' own struct (13.x): words 0-4 src (type, ptr, rowLength, layerHeight,
        locHint), 5-9 dst, 10-12 extent, 13 srcAccessOrder | flags << 32.
        """
        ops = np.zeros((int(width.shape[0]), 14), dtype=np.uint64)
        pointer, (by_stream, any_order) = _pointer_operand(), _access_orders()
        access = by_stream if stream_ordered else any_order
        ops[:, 0] = pointer
        ops[:, 1] = src
        ops[:, 2] = src_pitch
        ops[:, 3] = height
        ops[:, 5] = pointer
        ops[:, 6] = dst
        ops[:, 7] = dst_pitch
        ops[:, 8] = height
        ops[:, 10] = width
        ops[:, 11] = height
        ops[:, 12] = 1
        ops[:, 13] = access
        return ops

    def memcpy_pitched(self, ops: np.ndarray, stream: Any, *, hold_gil: bool | None = None) -> None:
        """Enqueue packed 2D copies (``pitched_ops`` rows, C-contiguous) on ``stream``.

        ``hold_gil``: keep the GIL through the call (None: only for a few ops, see
        ``GIL_HELD_PITCHED_OPS``; a lane's issuer thread passes True)."""
        n = int(ops.shape[0])
        if n == 0:
            return
        if self._batch3d_fn is None:
            raise CudaCallFailed("this driver has no cuMemcpy3DBatchAsync (needs CUDA 12.8+)",
                                 int(cu.CUresult.CUDA_ERROR_NOT_SUPPORTED))
        if hold_gil is None:
            hold_gil = n <= GIL_HELD_PITCHED_OPS
        fn = self._batch3d_fn_gil if hold_gil else self._batch3d_fn
        if self.batch_kind == "batch13":
            code = fn(n, ops.ctypes.data, 0, int(stream))
        else:
            fail_idx = ctypes.c_size_t(0)
            code = fn(n, ops.ctypes.data, ctypes.addressof(fail_idx), 0, int(stream))
        if code != 0:
            raise self.fail(int(code), "cuMemcpy3DBatchAsync")

    def _attr(self, stream_ordered: bool, to_host: bool | None) -> Any:
        """The ``CUmemcpyAttributes`` for these settings, kept for the driver's lifetime.

        Threads may build one at the same time (lanes, and the DMA submit threads): the
        first stored wins and every caller gets that one, so no call passes the address of
        an object that a later store let go of while the driver still reads it."""
        hints = to_host if self.use_location_hints else None
        attr = self._attrs.get((stream_ordered, hints))
        if attr is None:
            attr = cu.CUmemcpyAttributes()
            order = cu.CUmemcpySrcAccessOrder
            attr.srcAccessOrder = (
                order.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                if stream_ordered
                else order.CU_MEMCPY_SRC_ACCESS_ORDER_ANY
            )
            if hints is not None:
                host, dev = cu.CUmemLocation(), cu.CUmemLocation()
                host.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
                dev.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                dev.id = self.device_index
                attr.srcLocHint, attr.dstLocHint = (dev, host) if hints else (host, dev)
            attr.flags = 0
            attr = self._attrs.setdefault((stream_ordered, hints), attr)
        return attr

    def memcpy_batch(
        self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: Any, *,
        stream_ordered: bool = True, to_host: bool | None = None, hold_gil: bool | None = None,
    ) -> None:
        """Enqueue ``len(dst)`` copies on ``stream``; arrays are contiguous uint64 (or
        int64) of equal length. See ``memcpy_batch_at``."""
        n = int(dst.shape[0])
        if n:
            self.memcpy_batch_at(dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, n, stream,
                                 stream_ordered=stream_ordered, to_host=to_host, hold_gil=hold_gil)

    def memcpy_batch_at(
        self, dst: int, src: int, sizes: int, n: int, stream: Any, *,
        stream_ordered: bool = True, to_host: bool | None = None, hold_gil: bool | None = None,
    ) -> None:
        """Enqueue ``n`` copies on ``stream``, their destinations, sources and sizes read
        from the 8-byte arrays at host addresses ``dst``, ``src`` and ``sizes`` during the
        call (a caller's table needs no per-call conversion, which ``.ctypes.data`` is).

        ``hold_gil``: keep the GIL through the call (None: for batches of at most
        ``GIL_HELD_DESCRIPTORS``; a lane's issuer thread passes True, threads issuing slices
        side by side pass False). Falls back
        to one cuMemcpyAsync per entry where the driver lacks batched copies.
        """
        if n <= 0:
            return
        if self._batch_fn is None:
            table = (ctypes.c_uint64 * n)
            for d, s, k in zip(table.from_address(dst), table.from_address(src), table.from_address(sizes)):
                ret = cu.cuMemcpyAsync(d, s, k, stream)
                if ret[0] != OK:
                    raise self.fail(int(ret[0]), "cuMemcpyAsync")
            return
        attr = self._attr_at(stream_ordered, to_host)
        if hold_gil is None:
            hold_gil = n <= GIL_HELD_DESCRIPTORS
        fn = self._batch_fn_gil if hold_gil else self._batch_fn
        # Every copy takes attribute 0 (``_first_attr``, never written). CUDA 12.8's call
        # also reports the failing copy's index, which is never read: one shared output
        # serves every thread.
        if self.batch_kind == "batch12":
            code = fn(dst, src, sizes, n, attr, self._first_attr_at, 1, self._fail_idx_at, int(stream))
        else:
            code = fn(dst, src, sizes, n, attr, self._first_attr_at, 1, int(stream))
        if code != 0:
            raise self.fail(int(code), "cuMemcpyBatchAsync")

    def _attr_at(self, stream_ordered: bool, to_host: bool | None) -> int:
        """Address of the kept ``CUmemcpyAttributes`` for these settings (``_attr``)."""
        key = (stream_ordered, to_host if self.use_location_hints else None)
        at = self._attr_ptrs.get(key)
        if at is None:
            at = self._attr_ptrs[key] = int(self._attr(stream_ordered, to_host).getPtr())
        return at
