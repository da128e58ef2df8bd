"""A tier URL without its secrets, fit for messages and logs: the one redaction that
``RedisTier``'s label, its URL checks and the vLLM plug-in's ``aiokv_tiers`` parsing share
(free of redis-py, so the plug-in's checks run where it is not installed)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

__all__ = ["redacted"]

_SECRET_PARAM = re.compile(r"((?:^|&)[^=&]*password)=[^&]*", re.I)


def redacted(url: str) -> str:
    """``url`` without the passwords redis-py reads from it: the user part's and any
    ``password=`` or ``ssl_password=`` parameter's (each shown as ``***``)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rpartition('@')[2]}"
    query = _SECRET_PARAM.sub(r"\1=***", parts.query)
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if parts.query else "")
