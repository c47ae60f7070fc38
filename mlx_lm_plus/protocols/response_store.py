"""The Responses API's stored responses (`store`, default true): a bounded
in-memory store (count, bytes, time to live; least recently used first
out), each response kept as the JSON it is (a Python dict held 5 to 30
times its JSON length), its conversation's data URLs kept apart, so that
what --responses-store-bytes counts is what the store holds."""

import json
import sys
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

# Strings this long are kept as they are in a stored conversation, not
# written into its JSON: data URLs (tens of MB) would take the event loop's
# time to write and read (json holds the GIL for a whole string).
BIG_STRING_CHARS = 64 << 10
# What stands for big string i in a stored conversation's JSON: a nonce no
# client knows.
_BIG = "\x00mlx_lm_plus:" + uuid.uuid4().hex + ":"
# Python's own cost of an entry beyond its bytes: the entry, its two bytes
# objects, the store's key and ordered-dict node.
ENTRY_BYTES = 512


@dataclass
class _Stored:
    """A stored response as JSON bytes (what it costs is what it holds:
    the same values as Python objects took ~5 times their JSON, a `{}` 64
    bytes where JSON counts 2, and the budget meant nothing)."""

    response_json: bytes  # the Response object, as GET answers it
    # The conversation as chat messages, this response's output included
    # (its instructions not: a continuation brings its own), with its big
    # strings apart.
    messages_json: bytes
    big_strings: List[str]
    at: float

    @property
    def size(self) -> int:
        return (len(self.response_json) + len(self.messages_json) + ENTRY_BYTES
                + sum(sys.getsizeof(s) for s in self.big_strings))

    def messages(self) -> List[Dict[str, Any]]:
        """The stored conversation (a new copy at each call)."""
        return _unpack(json.loads(self.messages_json), self.big_strings)


def _pack(value: Any, big: List[str]) -> Any:
    """`value` with each string of BIG_STRING_CHARS or more replaced by a
    mark, the string appended to `big`. (Bodies nest at most
    bodies.MAX_JSON_DEPTH levels.)"""
    if isinstance(value, str):
        if len(value) < BIG_STRING_CHARS:
            return value
        big.append(value)
        return f"{_BIG}{len(big) - 1}"
    if isinstance(value, dict):
        return {k: _pack(v, big) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_pack(v, big) for v in value]
    return value


def _unpack(value: Any, big: List[str]) -> Any:
    if isinstance(value, str):
        return big[int(value[len(_BIG):])] if value.startswith(_BIG) else value
    if isinstance(value, dict):
        return {k: _unpack(v, big) for k, v in value.items()}
    if isinstance(value, list):
        return [_unpack(v, big) for v in value]
    return value


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class ResponseStore:
    """Stored responses, at most `max_responses` of them and `max_bytes` in
    all (each entry's JSON, counted alone even where conversations share
    messages), each for `ttl` seconds (None: no limit); the least recently
    used go first. Read by request parsing in an executor and written in
    one: one lock."""

    def __init__(self, max_responses: int = 1000, max_bytes: int = 256 * 1024**2,
                 ttl: Optional[float] = 24 * 3600.0, clock=time.monotonic):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        self._entries: "OrderedDict[str, Tuple[_Stored, int]]" = OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        if self.ttl is None:
            return
        now = self._clock()
        # Use doesn't extend the time to live: the oldest may be anywhere.
        for key in [k for k, (e, _) in self._entries.items() if now - e.at > self.ttl]:
            self._drop(key)

    def _drop(self, key: str) -> None:
        self.bytes -= self._entries.pop(key)[1]

    def put(self, response: Dict[str, Any], messages: List[Dict[str, Any]]) -> bool:
        """Store a response (False: it alone is over max_bytes, or the store
        holds nothing). Writes its JSON: not on the event loop."""
        big: List[str] = []
        entry = _Stored(_json(response), _json(_pack(messages, big)), big, self._clock())
        with self._lock:
            return self._put(response["id"], entry)

    def _put(self, key: str, entry: _Stored) -> bool:
        size = entry.size
        if key in self._entries:
            self._drop(key)
        if self.max_responses < 1 or size > self.max_bytes:
            return False
        self._expire()
        while self._entries and (len(self._entries) >= self.max_responses
                                 or self.bytes + size > self.max_bytes):
            self._drop(next(iter(self._entries)))
        self._entries[key] = (entry, size)
        self.bytes += size
        return True

    def get(self, key: str) -> Optional[_Stored]:
        with self._lock:
            self._expire()
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            return found[0]

    def delete(self, key: str) -> bool:
        with self._lock:
            self._expire()
            if key not in self._entries:
                return False
            self._drop(key)
            return True
