"""The model's own reasoning, handed to a client and taken back intact.

Clients of the agent protocols replay a thinking model's reasoning in the
next request as an opaque value the server gave them: the Responses API's
`encrypted_content` of a reasoning item (Codex sends `store: false` and
replays reasoning items that carry only that), Anthropic's `signature` of a
thinking block (Claude Code replays thinking blocks with it, and Anthropic's
API refuses them without one). Templates such as Qwen3.5's render the
reasoning after the last user message back into the prompt: without it the
model would read another context than the one it wrote in, and the prompt
cache would recompute from that point.

A sealed value here is the reasoning text itself and an HMAC-SHA256 of it
under a key made when the process starts: authenticated, not encrypted (the
text is the client's own answer). `open_sealed` gives the text back only for a
value this process sealed: a tampered, foreign or older (another process's)
value gives None, and the request goes on without that reasoning (the text
path), never an error. Token ids are not sealed: the template renders the
text, and the prompt cache matches what it renders.
"""

import base64
import binascii
import hashlib
import hmac
import secrets
from typing import Optional

# "mlxp1." + base64url(text) + "." + base64url(mac): a value no provider's
# own format shares.
PREFIX = "mlxp1."
_KEY = secrets.token_bytes(32)


def _mac(data: bytes) -> bytes:
    return hmac.new(_KEY, data, hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def seal(text: str) -> str:
    """`text` in a value only this process can open."""
    data = text.encode("utf-8", "surrogatepass")
    return PREFIX + _b64(data) + "." + _b64(_mac(data))


def open_sealed(value) -> Optional[str]:
    """The text `seal` sealed in `value`, or None (not ours, or changed)."""
    if not isinstance(value, str) or not value.startswith(PREFIX):
        return None
    body, _, mac = value[len(PREFIX):].rpartition(".")
    try:
        data, mac = _unb64(body), _unb64(mac)
    except (binascii.Error, ValueError):
        return None
    if not hmac.compare_digest(mac, _mac(data)):
        return None
    try:
        return data.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
