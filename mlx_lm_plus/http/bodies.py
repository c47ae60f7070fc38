"""Request bodies -> JSON, without stalling the event loop on large ones.

A large body is parsed in an executor, but json.loads and bytes.decode hold
the GIL for their whole length, so the event loop waits anyway: a body of
ten 11.6 MB screenshots (agents resend every image of a conversation each
turn) took 138 ms of one call, every stream stalled meanwhile. Nearly all
of such a body is the base64 of its data URLs, which needs no parsing: each
payload is cut out of the bytes first (found with bytes.find, memchr-fast),
the rest is parsed in a few milliseconds, and each payload is put back as a
string in a call of its own (a few ms each), between which the loop runs.
The result is json.loads(raw)'s, and so are the errors: anything unusual
(a payload with other characters than base64's) is left in place.

Images are then decoded from base64 to be checked and used:
`codec.b64decode` does it a piece at a time, for the same reason.
"""

import json
import uuid
from typing import Any, List

import numpy as np

# Payloads shorter than this are parsed where they are.
MIN_PAYLOAD_BYTES = 64 << 10
# Past either, the body is parsed whole: putting payloads back walks the
# parsed skeleton in Python, and each place searched is a turn of a loop.
MAX_SKELETON_BYTES = 1 << 20
MAX_PLACES = 1024
_BASE64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="
# What stands for payload i in the parsed skeleton: a nonce no client knows,
# and a fixed width.
_MARK = "mlxplus" + uuid.uuid4().hex
_MARK_CHARS = len(_MARK) + 8


# Arrays and objects nested deeper than this are refused: every stage after
# parsing recurses on what it is given (json.dumps writing a Responses echo,
# the template's tojson, llguidance, the Python walks of schemas), and near
# json.loads' own limit (about 1,000 levels: the recursion limit) one more
# level raised RecursionError in the middle of an open stream. serde_json,
# which llguidance parses schemas with, stops at 128 too.
MAX_JSON_DEPTH = 128


class BodyError(ValueError):
    """The body is not UTF-8 JSON (the message says why)."""


def parse_body(raw: bytes) -> Any:
    """json.loads(raw) (BodyError where it fails), with large base64
    payloads cut out of the bytes first and put back as strings."""
    payloads: List[bytes] = []
    pieces, pos, end = [], 0, 0  # (pos: copied up to; end: searched up to)
    for _ in range(MAX_PLACES):
        found = raw.find(b";base64,", end)
        if found < 0:
            break
        start = found + len(b";base64,")
        end = raw.find(b'"', start)
        if end < 0:
            break
        payload = raw[start:end] if end - start >= MIN_PAYLOAD_BYTES else None
        if payload is not None and not payload.translate(None, _BASE64):
            pieces += [raw[pos:start], f"{_MARK}{len(payloads):08d}".encode()]
            payloads.append(payload)
            pos = end
        del payload
    else:
        payloads.clear()  # (many places: not a body of a few images)
    if payloads:
        pieces.append(raw[pos:])
        skeleton = b"".join(pieces)
        del pieces
        if len(skeleton) <= MAX_SKELETON_BYTES:
            try:
                value = _loads(skeleton)
            except BodyError:
                pass  # (parsed whole: its own error, where it is)
            else:
                # (Base64 has no brackets: the skeleton's count is the body's.)
                check_depth(skeleton)
                return _put_back(value, payloads)
        payloads.clear()
    value = _loads(raw)
    check_depth(raw)
    return value


_DEPTH_PIECE = 1 << 20  # bytes scanned at once (~25 MB of numpy arrays)


def check_depth(raw: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """BodyError if the JSON text `raw` (valid: already parsed) nests
    arrays and objects deeper than `limit`. A body with at most `limit`
    brackets can't (the usual case, counted at memchr speed); in others the
    brackets outside strings are counted with numpy, a piece at a time
    (a walk of the parsed value took 1.7 s for an 8 MB body of empty
    lists; a regex for strings kept 64 bytes a backslash)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return
    depth, in_string, backslashes = 0, 0, 0  # (carried from piece to piece)
    for at in range(0, len(raw), _DEPTH_PIECE):
        piece = np.frombuffer(raw, np.uint8, min(_DEPTH_PIECE, len(raw) - at), at)
        index = np.arange(len(piece), dtype=np.int32)
        slash = piece == 92
        # Backslashes in a row just before each byte (those running on
        # from the previous piece included): a quote after an odd number
        # is escaped. (In valid JSON a backslash is only ever in a string.)
        last_other = np.maximum.accumulate(np.where(slash, np.int32(-1), index))
        run = index - last_other + np.where(last_other < 0, np.int32(backslashes), 0)
        before = np.concatenate((np.array([backslashes], np.int32), run[:-1]))
        quote = (piece == 34) & (before % 2 == 0)
        inside = (np.cumsum(quote, dtype=np.int32) + in_string) % 2 == 1
        steps = (((piece == 91) | (piece == 123)) & ~inside).astype(np.int32)
        steps -= ((piece == 93) | (piece == 125)) & ~inside
        running = np.cumsum(steps, dtype=np.int32)
        if depth + int(running.max()) > limit:
            raise BodyError(f"Request body nests arrays and objects more than {limit} "
                            "levels deep")
        depth += int(running[-1])
        in_string, backslashes = int(inside[-1]), int(run[-1])


def _loads(raw: bytes) -> Any:
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise BodyError(f"Request body is not valid UTF-8: {e}") from e
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise BodyError(f"Invalid JSON in request body: {e}") from e
    except ValueError as e:  # an integer of more than 4300 digits
        raise BodyError(f"Invalid JSON in request body: {e}") from e


def _put_back(value: Any, payloads: List[bytes]) -> Any:
    """`value` with each mark replaced by its payload (a string holds one
    where the payload was in the body: only strings are looked at)."""
    if isinstance(value, str):
        at = value.find(_MARK)
        while at >= 0:
            i = int(value[at + len(_MARK):at + _MARK_CHARS])
            value = value[:at] + payloads[i].decode("ascii") + value[at + _MARK_CHARS:]
            at = value.find(_MARK, at + len(payloads[i]))
        return value
    if isinstance(value, dict):
        return {_put_back(k, payloads): _put_back(v, payloads) for k, v in value.items()}
    if isinstance(value, list):
        return [_put_back(v, payloads) for v in value]
    return value
