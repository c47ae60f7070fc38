"""Request bodies parsed with their data URLs' base64 cut out first
(mlx_lm_plus/http/bodies.py): the same values and errors as json.loads, with
only a skeleton going through the parser in one call."""

import base64
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_lm_plus.http import bodies
from mlx_lm_plus.http.bodies import BodyError, parse_body


def image_url(n: int) -> str:
    return "data:image/png;base64," + base64.b64encode(os.urandom(n)).decode()


def test_payloads_are_not_parsed_with_the_rest(monkeypatch):
    parsed = []
    loads = json.loads
    monkeypatch.setattr(bodies.json, "loads", lambda text: parsed.append(len(text)) or loads(text))
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Which is \"the\" cat?\n"},
        *[{"type": "image_url", "image_url": {"url": image_url(300_000)}} for _ in range(3)]]}]}
    raw = json.dumps(body).encode()
    assert parse_body(raw) == body
    assert len(parsed) == 1 and parsed[0] < 1000 < len(raw)


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.sampled_from(["data:image/png;base64,", ";base64,", "\\", '"']),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values, st.lists(st.sampled_from([
    "data:image/png;base64,QUJD", ";base64,QUJDRA==", ";base64,QU\\/JD", ";base64,QU\nJD",
    "data:x;base64,", ";base64,QUJD\u00e9"]), max_size=3),
       st.booleans(), st.booleans())
def test_same_as_json_loads(monkeypatch, value, urls, ascii_only, compact):
    """Any JSON, with payloads of every kind (escaped, with other characters,
    empty) in strings and keys: the value json.loads gives. (The patch is
    the same for every example.)"""
    monkeypatch.setattr(bodies, "MIN_PAYLOAD_BYTES", 2)
    body = {"v": value, "urls": urls, **{u: i for i, u in enumerate(urls)}}
    raw = json.dumps(body, ensure_ascii=ascii_only,
                     separators=(",", ":") if compact else None).encode()
    assert parse_body(raw) == json.loads(raw)


@pytest.mark.parametrize("raw", [
    b'{"u": "data:x;base64,QUJDRA==', b'{"u": "data:x;base64,QUJDRA=="',
    b'{"u": "data:x;base64,QUJDRA==" "v"}', b'{"u": "data:x;base64,QUJDRA=="}}',
    b'{"u": "data:x;base64,QUJD\nRA=="}', b'{"u": "data:x;base64,QUJDRA==", "n": 1' + b"0" * 5000 + b"}",
    b'{"u": "data:x;base64,QUJDRA==", "b": "\xff"}', b'[' * 100_000 + b'"data:x;base64,QUJDRA=="',
])
def test_same_errors_as_json_loads(monkeypatch, raw):
    monkeypatch.setattr(bodies, "MIN_PAYLOAD_BYTES", 2)
    with pytest.raises(BodyError) as cut:
        parse_body(raw)
    monkeypatch.setattr(bodies, "MIN_PAYLOAD_BYTES", 1 << 60)
    with pytest.raises(BodyError) as whole:
        parse_body(raw)
    assert str(cut.value) == str(whole.value)


def test_bodies_unlike_a_few_images_are_parsed_whole(monkeypatch):
    """Putting payloads back walks the skeleton in Python, and each place
    searched is a turn of a loop: a large skeleton, or many places, and the
    body is parsed whole (still json.loads's value)."""
    parsed = []
    loads = json.loads
    monkeypatch.setattr(bodies.json, "loads", lambda text: parsed.append(len(text)) or loads(text))
    url = image_url(100_000)
    for body in [{"items": [0] * 600_000, "url": url},
                 {"small": [";base64,QUJD"] * (bodies.MAX_PLACES + 1), "url": url}]:
        raw = json.dumps(body).encode()
        parsed.clear()
        assert parse_body(raw) == body and parsed == [len(raw)]


@pytest.mark.parametrize("validate", [False, True])
def test_b64decode_in_pieces_is_base64s(monkeypatch, validate):
    """Images are decoded a piece at a time (binascii holds the GIL for a
    whole call, ~2 ms a MB): the bytes, and the errors, of one call."""
    import binascii

    from mlx_lm_plus import codec as bodies
    from mlx_lm_plus.codec import b64decode

    monkeypatch.setattr(bodies, "B64_PIECE_CHARS", 8)
    calls = []
    whole = base64.b64decode
    monkeypatch.setattr(bodies.base64, "b64decode",
                        lambda d, validate=False: calls.append(len(d)) or whole(d, validate=validate))
    data = [base64.b64encode(os.urandom(n)).decode() for n in (0, 1, 2, 3, 5, 6, 40, 41, 42)]
    for text in data + [t + "\n" for t in data] + [t.encode() for t in data]:
        calls.clear()
        assert b64decode(text, validate=validate if "\n" not in str(text) else False) == whole(
            text, validate=validate if "\n" not in str(text) else False)
    calls.clear()
    b64decode(data[6], validate=validate)
    assert len(calls) == 7  # (40 bytes: 56 characters, 8 a piece)
    for bad in ["QUJD" * 4 + "QU=D" + "QUJD" * 4, "QUJD" * 4 + "@@@@" + "QUJD", "QUJD" * 4 + "Q",
                "QUJDRA==" + "QUJD" * 4, "QUJD" * 3 + "é" * 4]:
        try:
            expected = whole(bad, validate=validate)
        except (binascii.Error, ValueError) as e:
            with pytest.raises(type(e)):
                b64decode(bad, validate=validate)
        else:
            assert b64decode(bad, validate=validate) == expected


def _depth(value) -> int:
    """Nesting of arrays and objects, walked (the reference)."""
    best, stack = 0, [(value, 1)] if isinstance(value, (list, dict)) else []
    while stack:
        v, d = stack.pop()
        best = max(best, d)
        stack += [(c, d + 1) for c in (v.values() if isinstance(v, dict) else v)
                  if isinstance(c, (list, dict))]
    return best


def test_the_nesting_bound_counts_brackets_outside_strings_only(monkeypatch):
    """bodies.check_depth against a walk of the parsed value, on random
    JSON full of brackets, quotes and backslashes inside strings, cut into
    7-byte pieces (what carries from piece to piece: open strings, runs of
    backslashes, the depth) and whole."""
    import random

    from mlx_lm_plus.http import bodies
    from mlx_lm_plus.http.bodies import BodyError, check_depth

    rng = random.Random(7)
    strings = ["x", 'a"b[', "\\", "]}{[", "é{", '\\"[[', "\\\\", '"']

    def value(d):
        r = rng.random()
        if d > 30 or r < 0.3:
            return rng.choice([*strings, 1, None])
        if r < 0.65:
            return [value(d + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(strings) + str(i): value(d + 1) for i in range(rng.randint(0, 3))}

    for piece in (7, 1 << 20):
        monkeypatch.setattr(bodies, "_DEPTH_PIECE", piece)
        for _ in range(1500):
            v = value(0)
            raw = json.dumps(v, ensure_ascii=rng.random() < 0.5).encode()
            depth = _depth(v)
            if raw.count(b"[") + raw.count(b"{") > depth - 1 >= 0:
                with pytest.raises(BodyError, match="levels deep"):
                    check_depth(raw, depth - 1)
            check_depth(raw, depth)


def test_the_nesting_bound_takes_linear_time_on_what_a_regex_choked_on():
    """Found in review: a regex for strings kept 64 bytes a backslash (a
    64 MB string of escaped quotes: 4 GB, 10 s, the GIL held); a walk of
    the parsed value took 1.7 s for 8 MB of empty lists. Both shapes, and
    short strings, at 8 MB: answered (the run would take minutes and
    gigabytes otherwise)."""
    from mlx_lm_plus.http.bodies import BodyError, check_depth

    check_depth(('{"m": [' + ", ".join(["[]"] * 1_000_000) + "]}").encode())
    check_depth(("[" + '"", ' * 2_000_000 + "[]]").encode())
    escaped = ('{"a": "' + '\\"' * 4_000_000 + '", "b": ' + "[" * 129 + "]" * 129 + "}").encode()
    with pytest.raises(BodyError):
        check_depth(escaped)
