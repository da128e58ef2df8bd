"""The driver package: the only code in aiokv that imports cuda-python.

``facade`` holds ``Driver`` (context, streams, events, pinned memory, kernels), ``batch``
its batched copy calls, ``codes`` the translation of driver return codes into
``aiokv.errors``. Everything else in the CUDA wing talks to the device through ``Driver``.
"""

from .batch import GIL_HELD_DESCRIPTORS, GIL_HELD_PITCHED_OPS
from .codes import translate
from .facade import Driver, JobEvents

__all__ = ["GIL_HELD_DESCRIPTORS", "GIL_HELD_PITCHED_OPS", "Driver", "JobEvents", "translate"]
