"""Optional packages, one entry per extra of ``pyproject.toml``: import one, or say which
extra brings it and how to install that extra, in one message format for every feature.

``import aiokv`` needs none of them; a feature calls ``require`` when it is first used.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from .errors import InvalidSpec, MissingExtra

__all__ = ["EXTRAS", "Extra", "install_hint", "require"]


@dataclass(frozen=True)
class Extra:
    """One optional extra: the module that proves it is installed and what needs it."""

    module: str
    feature: str


EXTRAS: dict[str, Extra] = {
    "redis": Extra("redis", "RedisTier"),
    "metrics": Extra("prometheus_client", "aiokv.metrics"),
    "plot": Extra("matplotlib", "aiokv bench --plot"),
}


def install_hint(extra: str) -> str:
    """The one sentence that says how to install ``extra`` (from a clone: the package is
    not published)."""
    return f"python3 -m pip install -e '.[{extra}]' in a clone of aiokv"


def require(extra: str, module: str | None = None) -> ModuleType:
    """Import ``module`` (default: the extra's own module) or raise ``MissingExtra``.

    Args:
        extra: a key of ``EXTRAS`` (``"redis"``, ``"metrics"``, ``"plot"``).
        module: a submodule to import instead (``"redis.asyncio"``); a failure inside the
            package itself (not a missing package) propagates as it is.

    Raises:
        MissingExtra: the package is absent; the message names the extra and how to
            install it. Also an ``ImportError``.
    """
    try:
        spec = EXTRAS[extra]
    except KeyError:
        raise InvalidSpec(f"no optional extra named {extra!r}; known: {sorted(EXTRAS)}") from None
    name = module or spec.module
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing = exc.name or name
        if missing.split(".")[0] != spec.module.split(".")[0]:
            raise  # something the package itself imports is broken: not a missing extra
        error = MissingExtra(
            f"{spec.feature} needs the optional package {spec.module!r} (not installed): "
            f"install the {extra!r} extra with {install_hint(extra)}"
        )
        error.name = spec.module
        raise error from exc
