"""Warnings logged once per process and key: a condition that every request
meets (a flag left off, a best-effort feature unavailable) is said once, not
once per request."""

import logging
import threading
from typing import Hashable, Optional

_said = set()
_lock = threading.Lock()


def warn_once(key: Hashable, message: Optional[str] = None) -> None:
    """Log `message` (or `key`, a string) as a warning the first time `key`
    is seen."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    logging.warning(key if message is None else message)
