"""Checkpoint positions: where a chat prompt's messages begin and end in its
tokens, found by sentinel substitution (render the conversation with a
message's content replaced by two sentinels, and the tokens common to both
renders end where that content starts), checked against the tokenizer, and
for vision prompts mapped onto the expanded image tokens. prompt.py cuts
the plan's segments there; the engine stores a cache entry at each.
"""

import array
import bisect
import itertools
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from tokenizers import Tokenizer

# Two sentinels with different first characters: whatever the real content
# starts with, one of them differs from it at once, so the shorter common
# prefix ends exactly where the content starts (or earlier, where the
# tokenizer merges the content with the text before it).
SENTINELS = ("\u2063a", "\u2063b")


def common_prefix(a: List[int], b: List[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _boundary(tokenizer, tokens, variants, kwargs) -> int:
    """Shortest common prefix of `tokens` and each variant's tokenization
    (-1 on error): the reference method, one full tokenization per variant."""
    best = len(tokens)
    for variant in variants:
        try:
            other = tokenizer.apply_chat_template(
                variant, add_generation_prompt=True, **kwargs
            )
        except Exception:
            return -1
        best = min(best, common_prefix(tokens, other))
    return best


def _with_content(messages, index, content):
    out = [dict(m) for m in messages]
    out[index]["content"] = content
    return out


def checkpoint_positions(tokenizer, messages, tokens, kwargs) -> List[tuple]:
    """Token positions worth a cache entry, found by sentinel substitution.

    Each position is where two renderings of the conversation stop agreeing
    when one message's content is replaced by a sentinel, so it is exact
    whatever the template does around it (and works for templates that reject
    a truncated message list):
      * "system": the start of the first non-system message's content, the
        prefix every conversation with these system messages shares;
      * "checkpoint": the start of the last user message's content (edits and
        regenerations of that message share it);
      * "checkpoint": the end of this conversation as the next turn renders it
        (the next turn appends an assistant reply and a user message; a
        thinking template re-renders the reply without its reasoning).
    Returns sorted (position, kind) pairs with 0 < position < len(tokens).

    The renderings are compared as tokens; `_TextBoundary` does it without
    tokenizing them whole where it can, with the same result.
    """
    fast = _TextBoundary.create(tokenizer, messages, tokens, kwargs)
    if fast is None:
        return _checkpoint_positions_reference(tokenizer, messages, tokens, kwargs)
    return _positions(messages, len(tokens), fast)


def _checkpoint_positions_reference(tokenizer, messages, tokens, kwargs) -> List[tuple]:
    """`checkpoint_positions` tokenizing every rendering whole."""
    return _positions(
        messages, len(tokens), lambda variants: _boundary(tokenizer, tokens, variants, kwargs)
    )


def _positions(messages, n, boundary) -> List[tuple]:
    """The positions of `checkpoint_positions`, `boundary(variants)` giving
    the shortest common prefix of the prompt's tokens and the variants'."""
    found = {}

    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
    if first is not None and first > 0:
        p = boundary([_with_content(messages, first, s) for s in SENTINELS])
        if 0 < p < n:
            found[p] = "system"

    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is not None:
        p = boundary([_with_content(messages, last_user, s) for s in SENTINELS])
        if 0 < p < n:
            found.setdefault(p, "checkpoint")

    if messages[-1]["role"] in ("user", "tool"):
        nexts = [
            [*messages, {"role": "assistant", "content": s}, {"role": "user", "content": s}]
            for s in SENTINELS
        ]
        p = boundary(nexts)
        if 0 < p < n:
            found.setdefault(p, "checkpoint")
    return sorted(found.items())


# chat template arguments that change how `apply_chat_template` tokenizes
# its rendering (the fast path tokenizes renderings itself).
_TOKENIZE_KWARGS = ("sanitize_control_tokens", "tokenizer_kwargs", "truncation", "max_length",
                    "padding", "return_tensors", "return_dict", "return_assistant_tokens_mask")
# backend tokenizer -> (its vocabulary size, `_split_tokens`)
_SPLIT_TOKENS = weakref.WeakKeyDictionary()
# backend tokenizer -> prompts on which its encode agreed with
# `apply_chat_template` (-1: it did not once, so it is never trusted)
_VERIFIED = weakref.WeakKeyDictionary()
VERIFY_PROMPTS = 3


def _checked(count: int, agrees: bool) -> int:
    """A verification count after one more check. -1 stays: a check that
    began before a disagreement does not undo it (callers hold a lock)."""
    return -1 if count < 0 or not agrees else count + 1


def _split_tokens(backend) -> Dict[int, str]:
    """id -> text of the added tokens that cut any text they occur in.

    A fast tokenizer first finds its added tokens in the raw text (leftmost,
    longest match), then tokenizes the pieces between them one by one. Where
    two texts agree up to (or from) such a token, it is found in both: it
    needs no context (no whitespace stripping, no word check, not matched
    after normalizing), and no longer added token contains it (one starting
    at or before it and running into where the texts differ would win).
    """
    size = backend.get_vocab_size(with_added_tokens=True)
    cached = _SPLIT_TOKENS.get(backend)
    if cached is None or cached[0] != size:
        added = backend.get_added_tokens_decoder()
        joined = "\0".join(t.content for t in added.values())
        splits = {
            i: t.content
            for i, t in added.items()
            if t.content
            and "\0" not in t.content
            and not (t.lstrip or t.rstrip or t.single_word or t.normalized)
            and joined.count(t.content) == 1
        }
        cached = _SPLIT_TOKENS[backend] = (size, splits)
    return cached[1]


def _encode(backend, text: str):
    """(ids, offsets) of `text`. encode_batch lets go of the GIL while it
    works (encode holds it: a megabyte prompt would stall the event loop and
    the generation thread for a second); same ids and offsets."""
    (encoding,) = backend.encode_batch([text], add_special_tokens=False)
    return encoding.ids, encoding.offsets


def _find_splits(backend, text: str, tokens, offsets, first: int = 0, start: int = 0):
    """(token index, start, end) of the split tokens among `tokens` of
    `text`, numbered from `first` and placed from character `start`."""
    split_tokens = _split_tokens(backend)
    return [
        (first + i, start + offsets[i][0], start + offsets[i][1])
        for i, t in enumerate(tokens)
        if t in split_tokens and text[offsets[i][0] : offsets[i][1]] == split_tokens[t]
    ]


@dataclass(eq=False)
class _Encoded:
    """A prompt as `_RecentPrompts` keeps it: flat arrays, not lists of
    Python ints and tuples (a prompt of split tokens held 190 bytes each)."""
    text: str
    tokens: array.array
    splits: array.array  # (token index, start, end) of its split tokens, flat
    ends: array.array  # the splits' ends

    def split(self, j: int) -> tuple:
        return tuple(self.splits[3 * j : 3 * j + 3])

    def splits_before(self, j: int) -> List[tuple]:
        s = self.splits
        return list(zip(s[0 : 3 * j : 3], s[1 : 3 * j : 3], s[2 : 3 * j : 3]))


class _RecentPrompts:
    """The last prompts one tokenizer encoded, so that a new prompt is
    encoded from where it leaves the closest of them: the next turn of a
    conversation repeats the last one's text up to its reply, an edit up to
    the edited message. Its tokens there are the old prompt's, up to the
    last split token (`_split_tokens`) ending before the texts differ: a
    fast tokenizer tokenizes the text between split tokens piece by piece.
    On the first prompts that take this path the whole text is encoded too
    and must agree, else this tokenizer never takes it (as `for_prompt`).

    It does not hold the tokenizer (`_RECENT` is keyed by it, weakly: an
    unloaded model's tokenizer goes, and this with it)."""

    SIZE = 8  # prompts kept (their text, and their tokens at 4 bytes each) ...
    MAX_CHARS = 1 << 21  # ... while they hold at most this much text
    MIN_SHARED = 256  # characters in common below which encoding whole is as quick

    def __init__(self):
        self.lock = threading.Lock()  # (for changes: `entries` is replaced whole)
        self.entries: List[_Encoded] = []  # most recently used first
        self.verified = 0  # pieced encodings that agreed with whole ones; -1: one did not

    def _closest(self, text: str):
        """(entry, characters in common) of the entry sharing most with `text`."""
        best, shared = None, self.MIN_SHARED - 1
        for entry in self.entries:
            n = _common_text(text, entry.text)
            if n > shared:
                best, shared = entry, n
        return best, shared

    @staticmethod
    def _pieced(backend, text: str, base: _Encoded, shared: int):
        """`text`'s (tokens, splits): `base`'s up to its last split token
        ending within the `shared` characters, then the rest encoded. None
        where `base` has no split token there."""
        j = bisect.bisect_right(base.ends, shared) - 1
        if j < 0:
            return None
        first, start, end = base.split(j)
        ids, offsets = _encode(backend, text[start:])
        # (it is there, by `_split_tokens`; a check is cheap)
        if ids[:1] != [base.tokens[first]] or offsets[0] != (0, end - start):
            return None
        splits = _find_splits(backend, text[start:], ids, offsets, first, start)
        return base.tokens[:first].tolist() + ids, base.splits_before(j) + splits

    def _agrees(self, agrees: bool):
        with self.lock:
            self.verified = _checked(self.verified, agrees)

    def encode(self, backend, text: str):
        """`text`'s tokens (a list) and split tokens."""
        base, shared, pieced = None, 0, None
        if self.verified >= 0:
            base, shared = self._closest(text)
            pieced = base and self._pieced(backend, text, base, shared)
        if pieced and self.verified < VERIFY_PROMPTS:
            whole = _encode(backend, text)[0]
            self._agrees(whole == pieced[0])
            if whole != pieced[0]:
                logging.warning("Prompt planning: this tokenizer encodes a prompt in pieces "
                                "otherwise than whole; prompts are encoded whole from now on")
                pieced = None
        if pieced:
            tokens, splits = pieced
        else:
            ids, offsets = _encode(backend, text)
            tokens, splits = ids, _find_splits(backend, text, ids, offsets)
        if self.verified < 0:
            self.entries = []
        elif base is not None and shared == len(text) == len(base.text):
            self._keep(base)  # (the same prompt again)
        elif len(text) <= self.MAX_CHARS:
            flat = array.array("q", itertools.chain.from_iterable(splits))
            self._keep(_Encoded(text, array.array("i", tokens), flat, flat[2::3]), base)
        return tokens, splits

    def _keep(self, entry: _Encoded, base: Optional[_Encoded] = None):
        """`entry` first, then `base` (the one it came from), then the rest,
        as many as SIZE and MAX_CHARS allow."""
        with self.lock:
            used = [e for e in (entry, base) if e is not None]
            kept, chars = [], 0
            for e in used + [e for e in self.entries if e not in used]:
                chars += len(e.text)
                if len(kept) == self.SIZE or chars > self.MAX_CHARS:
                    break
                kept.append(e)
            self.entries = kept


# backend tokenizer -> its _RecentPrompts
_RECENT = weakref.WeakKeyDictionary()
_RECENT_LOCK = threading.Lock()


def _recent_prompts(backend) -> _RecentPrompts:
    with _RECENT_LOCK:
        recent = _RECENT.get(backend)
        if recent is None:
            recent = _RECENT[backend] = _RecentPrompts()
        return recent


class _NotHere(Exception):
    """The fast path cannot vouch for this boundary."""


class _TextBoundary:
    """`_boundary` without tokenizing the variants whole.

    A variant's rendering agrees with the prompt's text up to some character
    and again over a common end. Its tokens are the prompt's up to the last
    split token (`_split_tokens`) before the difference; from there they are
    those of the window of its text that ends with the first split token of
    the common end, and tokenizing that window alone gives them.
    """

    def __init__(self, tokenizer, backend, text, tokens, splits, kwargs):
        self.tokenizer, self.backend, self.kwargs = tokenizer, backend, kwargs
        self.text, self.tokens = text, tokens
        # (token index, start, end) of the prompt's split tokens, in order
        self.splits = splits
        self.starts = [s for _, s, _ in self.splits]
        self.ends = [e for _, _, e in self.splits]

    @staticmethod
    def _backend(tokenizer, kwargs):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if (
            not isinstance(backend, Tokenizer)
            or backend.encode_special_tokens  # added tokens read as text
            or backend.truncation
            or backend.padding
            or any(k in kwargs for k in _TOKENIZE_KWARGS)
            or kwargs.get("tokenize", True) is not True
        ):
            return None
        return backend

    @classmethod
    def _encoded(cls, tokenizer, backend, messages, kwargs):
        """The prompt rendered as text and tokenized once, with offsets."""
        render = {**kwargs, "tokenize": False}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **render)
        tokens, splits = _recent_prompts(backend).encode(backend, text)
        return cls(tokenizer, backend, text, tokens, splits, render)

    @classmethod
    def create(cls, tokenizer, messages, tokens, kwargs):
        """The fast path for this prompt, or None where it does not apply."""
        backend = cls._backend(tokenizer, kwargs)
        if backend is None:
            return None
        try:
            fast = cls._encoded(tokenizer, backend, messages, kwargs)
        except Exception:
            return None
        # The backend must tokenize this prompt as `apply_chat_template` did
        # (and `tokens` be this conversation's).
        return fast if fast.tokens == list(tokens) else None

    @classmethod
    def for_prompt(cls, tokenizer, messages, kwargs):
        """The fast path with the prompt's tokens from its own tokenization
        (render, then the backend's encode: what `apply_chat_template` does
        with a fast tokenizer), or None where it does not apply. For the first
        prompts of each tokenizer `apply_chat_template` tokenizes too and must
        agree, else this tokenizer never takes this path."""
        backend = cls._backend(tokenizer, kwargs)
        if backend is None or _VERIFIED.get(backend, 0) < 0:
            return None
        fast = cls._encoded(tokenizer, backend, messages, kwargs)
        checked = _VERIFIED.get(backend, 0)
        if checked < VERIFY_PROMPTS:
            agrees = fast.tokens == list(tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, **kwargs))
            with _RECENT_LOCK:  # (the module's lock for its per-tokenizer tables)
                _VERIFIED[backend] = _checked(_VERIFIED.get(backend, 0), agrees)
            if not agrees:
                return None
        return fast

    def __call__(self, variants) -> int:
        # Renderings are cheap, tokenizations are not.
        try:
            texts = [
                self.tokenizer.apply_chat_template(v, add_generation_prompt=True, **self.kwargs)
                for v in variants
            ]
        except Exception:
            return -1
        try:
            return min([len(self.tokens)] + [self._common_tokens(t) for t in texts])
        except _NotHere:
            return _boundary(self.tokenizer, self.tokens, variants, {**self.kwargs, "tokenize": True})

    def _common_tokens(self, other: str) -> int:
        """common_prefix(self.tokens, the tokens of the text `other`)."""
        text, tokens, splits = self.text, self.tokens, self.splits
        d = _common_text(text, other)
        common_end = _common_text(text, other, min(len(text), len(other)) - d, suffix=True)
        # The window: from the last split token ending at or before d ...
        j = bisect.bisect_right(self.ends, d) - 1
        first, start = (splits[j][0], splits[j][1]) if j >= 0 else (0, 0)
        # ... to the end of the first one in the common end (or the end).
        t = bisect.bisect_left(self.starts, len(text) - common_end)
        shift = len(other) - len(text)
        end = splits[t][2] + shift if t < len(splits) else len(other)
        window = self.backend.encode(other[start:end], add_special_tokens=False)
        ids, offsets = window.ids, window.offsets
        # Both split tokens must be where they were (they are, by
        # `_split_tokens`; a check is cheap).
        if j >= 0 and (ids[:1] != [tokens[first]] or offsets[0] != (0, splits[j][2] - start)):
            raise _NotHere
        if t < len(splits):
            last, s, e = splits[t]
            if ids[-1:] != [tokens[last]] or offsets[-1] != (s + shift - start, e + shift - start):
                raise _NotHere
        n = common_prefix(itertools.islice(tokens, first, None), ids)
        if n == len(ids) and t < len(splits):
            # The window agrees to its end (a normalizer dropped the
            # difference): what follows it decides.
            raise _NotHere
        return first + n


def _common_text(a: str, b: str, limit: Optional[int] = None, suffix: bool = False) -> int:
    """Length of the common prefix (suffix) of two strings, at most `limit`:
    a bisection of C-speed slice comparisons rather than a loop over characters."""
    if suffix:
        a, b = a[::-1], b[::-1]
    lo, hi = 0, min(len(a), len(b), len(a) if limit is None else limit)
    while lo < hi:  # a[:lo] == b[:lo]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def image_checkpoint_positions(tokenizer, messages, tokens, vision, kwargs) -> List[tuple]:
    """Checkpoints of a prompt with images: the end of each image (the same
    picture with another question, or an edit after it, resumes there
    without the vision tower), and the message boundaries of
    `checkpoint_positions`.

    The template writes each image as one placeholder token, which the
    processor expands into the image's tokens (and, in some families, markup
    around them): the boundaries are found in the prompt as the template
    tokenizes it, then moved past the expansions before them. If the two
    tokenizations disagree on the text, only the image ends are kept.
    """
    n = len(tokens)
    found = {img.end: "checkpoint" for img in vision.images if img.end < n}
    rendered = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  **kwargs))
    blanks: Dict[int, bool] = {}

    def blank(token: int) -> bool:
        if token not in blanks:
            blanks[token] = tokenizer.decode([token]).strip() == ""
        return blanks[token]

    expanded = (_expanded_position(rendered, tokens, vision)
                or _expanded_position(rendered, tokens, vision, blank))
    if expanded is not None:
        for p, kind in checkpoint_positions(tokenizer, messages, rendered, kwargs):
            p = vision.safe_prefix(expanded(p))
            if 0 < p < n:
                found.setdefault(p, kind)
    return sorted(found.items())


def _expanded_position(rendered: List[int], tokens: List[int], vision, blank=None):
    """A function from a position in `rendered` (one placeholder per image)
    to the same place in `tokens` (images expanded), or None where the two
    differ outside the images.

    The template's text between two placeholders is found after the first
    image's end, the text after the last one ends the prompt. With `blank`
    (whether a token is whitespace), whitespace tokens next to a placeholder
    are left out of the match: a processor that writes blank lines around an
    image (Gemma 3) may have its newlines merged with the template's into
    other tokens; a position in such whitespace goes to the nearest matched
    token."""
    holders = [i for i, t in enumerate(rendered) if t == vision.placeholder]
    images = vision.images
    if not images or len(holders) != len(images):
        return None
    # Each stretch of the template's text around the placeholders:
    # (its start, its matched core's start and end in `rendered`, the
    # core's start in `tokens`).
    stretches = []
    bounds = [-1, *holders, len(rendered)]
    for k in range(len(bounds) - 1):
        lo, hi = bounds[k] + 1, bounds[k + 1]
        a, b = lo, hi
        while blank and a < b and k > 0 and blank(rendered[a]):
            a += 1
        while blank and a < b and k < len(holders) and blank(rendered[b - 1]):
            b -= 1
        core = rendered[a:b]
        if k == 0:
            candidates = [0]
        elif k == len(holders):
            candidates = [len(tokens) - len(core)]
        else:
            candidates = range(images[k - 1].end, images[k].start - len(core) + 1)
        at = next((j for j in candidates
                   if j >= (images[k - 1].end if k else 0) and tokens[j : j + len(core)] == core),
                  None)
        if at is None:
            return None
        stretches.append((lo, a, b, at))

    def expanded(p: int) -> int:
        k = bisect.bisect_right([lo for lo, _, _, _ in stretches], p) - 1
        _, a, b, at = stretches[max(k, 0)]
        return at + min(max(p, a), b) - a

    return expanded


def rendered_with_positions(tokenizer, messages, kwargs) -> Optional[Tuple[List[int], List[tuple]]]:
    """(the prompt's tokens, its checkpoint positions) from one
    tokenization of the rendered text, where the tokenizer allows it
    (_TextBoundary); None: render and tokenize the usual way."""
    fast = _TextBoundary.for_prompt(tokenizer, messages, kwargs)
    if fast is None:
        return None
    return fast.tokens, _positions(messages, len(fast.tokens), fast)
