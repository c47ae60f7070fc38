"""Base64 as request bodies carry it (images, documents): decoded a piece at
a time, so that a large payload lets other threads run."""

import base64

_BASE64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="
# Base64 decoded in pieces of this many characters (~2 ms each).
B64_PIECE_CHARS = 1 << 20


def b64decode(data, validate: bool = False) -> bytes:
    """base64.b64decode(data, validate=validate), a piece at a time where
    `data` is plain base64 (whole quartets, padding only at the end), so
    that the GIL is let go between pieces; anything else, whole."""
    if len(data) <= B64_PIECE_CHARS or (isinstance(data, str) and not data.isascii()):
        return base64.b64decode(data, validate=validate)
    raw = data.encode() if isinstance(data, str) else bytes(data)
    padding = raw.find(b"=")
    if len(raw) % 4 or raw.translate(None, _BASE64) or 0 <= padding < len(raw) - 2:
        return base64.b64decode(raw, validate=validate)
    return b"".join(base64.b64decode(raw[i:i + B64_PIECE_CHARS], validate=validate)
                    for i in range(0, len(raw), B64_PIECE_CHARS))
