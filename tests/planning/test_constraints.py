"""The constraint engine (mlx_lm_plus.planning.constraints) on the tiny random model.

A random model writes garbage; under the processor it must write JSON valid
for each corpus schema, well-formed forced tool calls, and leave thinking and
unconstrained neighbours in the batch alone. The whole corpus runs as one
BatchGenerator batch, greedy (the default sampler).
"""

import json
import re
from datetime import date

import jsonschema
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from mlx_lm_plus import patches
from mlx_lm_plus.planning.constraints import ConstraintProcessor, mask_cost, processor_for
from mlx_lm_plus.planning.grammars import (
    ConstraintError,
    StrictToolCalls,
    compile_response_format,
    grammar_for,
    tool_call_grammar,
)
from testkit.schema_corpus import SAMPLES, SCHEMAS, UNSUPPORTED

MAX_TOKENS = 400

# jsonschema checks date-time, time and hostname only with optional packages
# this venv lacks; RFC 3339 / RFC 1123 checks of our own fill the gap.
FORMATS = jsonschema.FormatChecker()
_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"


@FORMATS.checks("time")
def _is_time(value):
    return not isinstance(value, str) or re.fullmatch(_TIME, value) is not None


@FORMATS.checks("date-time", raises=ValueError)
def _is_date_time(value):
    if not isinstance(value, str):
        return True
    date.fromisoformat(value[:10])
    return len(value) > 11 and value[10] in "Tt " and _is_time(value[11:])


@FORMATS.checks("hostname")
def _is_hostname(value):
    return not isinstance(value, str) or (
        len(value) <= 253 and re.fullmatch(rf"{_LABEL}(\.{_LABEL})*", value) is not None)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: {}
]
PARAMS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object",
          "additionalProperties": False}) for t in TOOLS}


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def qwen3(fixture_path):
    patches.apply_all()  # the batched step, as the engine runs it
    return load(str(fixture_path("qwen3")))


@pytest.fixture(params=["batched", "per_row"])
def step_kind(request):
    """Both ways a batch reaches the processor: one mask_batch call per
    step (patches/batched_logits_processors) and upstream's per-row calls."""
    patch = patches.batched_logits_processors
    if request.param == "per_row":
        patch.revert()
    yield request.param
    patch.apply()


def prompt_of(tok, text, **kw):
    return tok.apply_chat_template([{"role": "user", "content": text}],
                                   add_generation_prompt=True, **kw)


def run_batch(model, tok, prompts, processors, max_tokens):
    """Greedy, one BatchGenerator: [(tokens without the stop token, finish_reason)]."""
    gen = BatchGenerator(model, stop_tokens=[[i] for i in tok.eos_token_ids],
                         completion_batch_size=64, prefill_batch_size=64)
    uids = gen.insert(prompts, max_tokens=max_tokens,
                      logits_processors=[[p] if p else [] for p in processors])
    out, finish = {u: [] for u in uids}, {}
    while len(finish) < len(uids):
        for r in gen.next_generated():
            if r.finish_reason != "stop":
                out[r.uid].append(r.token)
            if r.finish_reason is not None:
                finish[r.uid] = r.finish_reason
    gen.close()
    return [(out[u], finish[u]) for u in uids]


def tool_calls(tok, text):
    """The calls in `text`, read as the server does: the tokenizer's parser on
    what lies between <tool_call> and </tool_call>."""
    calls = []
    for chunk in text.split(tok.tool_call_start)[1:]:
        inner, end, rest = chunk.partition(tok.tool_call_end)
        assert end and not rest.strip(), text
        calls.append(tok.tool_parser(inner, TOOLS))
    return calls


@pytest.fixture(scope="module")
def corpus_run(qwen3):
    """Every corpus schema, json_object, and forced tool calls, in one batch."""
    model, tok = qwen3
    cases = [(name, compile_response_format(schema_format(s))) for name, s in SCHEMAS]
    cases.append(("json_object", compile_response_format({"type": "json_object"})))
    cases += [
        ("tool:get_weather", tool_call_grammar(TOOLS, "get_weather", tokenizer=tok)),
        ("tool:ping", tool_call_grammar(TOOLS, "ping", tokenizer=tok)),
        ("tool:any", tool_call_grammar(TOOLS, tokenizer=tok)),
        ("tool:parallel", tool_call_grammar(TOOLS, tokenizer=tok, parallel=True)),
    ]
    procs = [ConstraintProcessor(g, tok) for _, g in cases]
    prompts = [prompt_of(tok, f"Answer in JSON, please ({i}).") for i in range(len(cases))]
    results = run_batch(model, tok, prompts, procs, [MAX_TOKENS] * len(cases))
    return {name: (tok.decode(out), finish, proc)
            for (name, _), (out, finish), proc in zip(cases, results, procs)}


def test_corpus_outputs_are_valid(corpus_run):
    schemas = dict(SCHEMAS)
    finished = 0
    for name, schema in schemas.items():
        text, finish, proc = corpus_run[name]
        assert proc.error is None, (name, proc.error)
        if finish == "stop":  # ended by EOS: the grammar was complete
            finished += 1
            jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)
        else:
            assert finish == "length", (name, finish)
    # Not vacuous: a random model finishes nearly everything once constrained.
    assert finished >= len(schemas) - 3, finished


def test_json_object(corpus_run):
    text, finish, proc = corpus_run["json_object"]
    assert proc.error is None
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_forced_tool_calls(corpus_run, qwen3):
    _, tok = qwen3
    for key in ("tool:get_weather", "tool:ping", "tool:any", "tool:parallel"):
        text, finish, proc = corpus_run[key]
        assert finish == "stop" and proc.error is None, (key, finish, text)
        assert text.startswith("<tool_call>\n{\"name\": "), text
        calls = tool_calls(tok, text)
        assert calls and (len(calls) == 1 or key == "tool:parallel"), text
        for call in calls:
            assert call["name"] in PARAMS, call
            if key != "tool:any" and key != "tool:parallel":
                assert call["name"] == key.split(":")[1]
            jsonschema.validate(call["arguments"], PARAMS[call["name"]], format_checker=FORMATS)


def test_tool_call_start_is_the_special_token(qwen3):
    """<tool_call> is matched as the tokenizer's one special token, which the
    model emits, not as its characters spelled in pieces."""
    _, tok = qwen3
    proc = ConstraintProcessor(tool_call_grammar(TOOLS, "add", tokenizer=tok), tok)
    prompt = mx.array(prompt_of(tok, "add"))
    out = proc(prompt, mx.zeros((1, len(tok.vocab))))
    allowed = mx.isfinite(out[0]).tolist()
    assert [i for i, a in enumerate(allowed) if a] == [tok.convert_tokens_to_ids("<tool_call>")]


def test_unsupported_schemas_raise():
    for name, body, reason in UNSUPPORTED:
        with pytest.raises(ConstraintError) as e:
            compile_response_format(body)
        assert reason in str(e.value), (name, str(e.value))


def test_odd_bodies_raise():
    with pytest.raises(ConstraintError, match="name must be"):  # `$` would let "\n" in
        compile_response_format({"type": "json_schema", "json_schema": {
            "name": "name\n", "schema": {"type": "object"}}})
    with pytest.raises(ConstraintError, match="invalid JSON schema"):  # NaN is not JSON
        compile_response_format(schema_format({"type": "number", "maximum": float("nan")}))


def test_text_is_unconstrained_and_schemas_are_cached():
    assert compile_response_format(None) is None
    assert compile_response_format({"type": "text"}) is None
    a = compile_response_format(schema_format({"type": "object", "properties": {"x": {}}}))
    b = compile_response_format(schema_format({"type": "object", "properties": {"x": {}}}))
    assert a is b  # the second compile is a cache hit


def test_bad_tools_raise(qwen3):
    _, tok = qwen3
    with pytest.raises(ConstraintError, match="not among the tools"):
        tool_call_grammar(TOOLS, "nope", tokenizer=tok)
    with pytest.raises(ConstraintError, match="non-empty"):
        tool_call_grammar([], tokenizer=tok)
    with pytest.raises(ConstraintError, match="function name"):
        tool_call_grammar([{"type": "function", "function": {"name": "a b"}}], tokenizer=tok)
    with pytest.raises(ConstraintError, match="uniqueItems"):
        tool_call_grammar([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "array", "uniqueItems": True}}}], tokenizer=tok)


def test_batch_independence(qwen3, step_kind):
    """A constrained and an unconstrained request in one batch each give what
    they give alone (different prompt lengths: padding is exercised too)."""
    model, tok = qwen3
    grammar = compile_response_format(schema_format(dict(SCHEMAS)["person"]))
    prompts = [prompt_of(tok, "Who is she? Reply in JSON."),
               prompt_of(tok, "Tell me a short story about the river and the boat at night.")]

    def procs():
        return [ConstraintProcessor(grammar, tok), None]

    together = run_batch(model, tok, prompts, procs(), [40, 40])
    alone = [run_batch(model, tok, [p], [proc], [40])[0] for p, proc in zip(prompts, procs())]
    assert together == alone
    json.loads(tok.decode(together[0][0]))  # the constrained one is JSON ...
    free = tok.decode(together[1][0])
    with pytest.raises(ValueError):  # ... and the other one is not
        json.loads(free)


def test_thinking_passes_logits_until_think_end(qwen3):
    _, tok = qwen3
    grammar = compile_response_format(schema_format(dict(SCHEMAS)["booleans"]))
    think_end = tok.convert_tokens_to_ids("</think>")
    prompt = prompt_of(tok, "Think, then answer.")
    prompt += tok.encode("<think>\n", add_special_tokens=False)
    proc = ConstraintProcessor(grammar, tok, after_think=True)
    logits = mx.random.normal((1, len(tok.vocab)), key=mx.random.key(0))
    tokens = list(prompt)
    for t in [None] + tok.encode(" hmm, let me see", add_special_tokens=False):
        if t is not None:
            tokens.append(t)
        assert proc(mx.array(tokens), logits) is logits  # untouched, not even copied
    assert not proc.started
    tokens.append(think_end)
    masked = proc(mx.array(tokens), logits)
    assert proc.started
    finite = mx.isfinite(masked[0]).tolist()
    assert sum(finite) < len(finite) // 4  # constrained now: '{' and little else
    assert tok.decode([finite.index(True)]).startswith("{")


def test_thinking_prompt_states(qwen3):
    """The prompt decides where a thinking model starts (see the class doc)."""
    _, tok = qwen3
    grammar = compile_response_format({"type": "json_object"})
    think_start = tok.convert_tokens_to_ids("<think>")
    logits = mx.zeros((1, len(tok.vocab)))

    # enable_thinking=False: the template closed the block: constrained at once.
    off = ConstraintProcessor(grammar, tok, after_think=True)
    out = off(mx.array(prompt_of(tok, "x", enable_thinking=False)), logits)
    assert off.started and not mx.isfinite(out[0, think_start]).item()

    # No marker: the first token may open a block, or start the JSON.
    maybe = ConstraintProcessor(grammar, tok, after_think=True)
    prompt = prompt_of(tok, "x")
    out = maybe(mx.array(prompt), logits)
    assert mx.isfinite(out[0, think_start]).item()
    assert maybe(mx.array(prompt + [think_start]), logits) is logits  # it opened one
    assert not maybe.started

    # A think block from an earlier turn does not close this one.
    earlier = tok.encode("<|im_start|>assistant\n<think>a</think>b<|im_end|>\n",
                         add_special_tokens=False)
    history = ConstraintProcessor(grammar, tok, after_think=True)
    out = history(mx.array(earlier + prompt), logits)
    assert mx.isfinite(out[0, think_start]).item()
    brace = tok.encode("{", add_special_tokens=False)[0]
    history(mx.array(earlier + prompt + [brace]), logits)  # it chose the JSON
    assert history.started and history.error is None


def test_think_start_is_offered_only_before_the_block(qwen3):
    """A model that opens a block at the first step and closes it is then
    held to the grammar: <think> is not offered again (it was, and a model
    that took it failed its request)."""
    _, tok = qwen3
    grammar = compile_response_format({"type": "json_object"})
    think_start = tok.convert_tokens_to_ids("<think>")
    think_end = tok.convert_tokens_to_ids("</think>")
    logits = mx.zeros((1, len(tok.vocab)))
    proc = ConstraintProcessor(grammar, tok, after_think=True)
    prompt = prompt_of(tok, "x")
    proc(mx.array(prompt), logits)
    word = tok.encode("a", add_special_tokens=False)
    assert proc(mx.array(prompt + [think_start]), logits) is logits
    assert proc(mx.array(prompt + [think_start] + word), logits) is logits
    out = proc(mx.array(prompt + [think_start] + word + [think_end]), logits)
    assert proc.started and proc.error is None
    assert not mx.isfinite(out[0, think_start]).item()
    brace = tok.encode("{", add_special_tokens=False)[0]
    assert mx.isfinite(out[0, brace]).item()


def test_a_text_prompt_without_markers_is_constrained_at_once(qwen3):
    _, tok = qwen3
    grammar = compile_response_format({"type": "json_object"})
    proc = processor_for(grammar, tok, prompt=None, chat=False)
    out = proc(mx.array(tok.encode("Answer:", add_special_tokens=False)),
               mx.zeros((1, len(tok.vocab))))
    assert proc.started
    assert not mx.isfinite(out[0, tok.convert_tokens_to_ids("<think>")]).item()


def test_thinking_end_to_end(qwen3):
    """The model thinks (free), emits </think>, then writes valid JSON."""
    model, tok = qwen3
    schema = dict(SCHEMAS)["nested_address"]
    think_end = tok.convert_tokens_to_ids("</think>")
    prompt = prompt_of(tok, "Where?") + tok.encode("<think>\n", add_special_tokens=False)

    class ForceThinkEnd:
        """Lets the model think for 6 tokens, then forces </think>."""

        def __init__(self):
            self.calls = 0

        def __call__(self, tokens, logits):
            self.calls += 1
            if self.calls == 7:
                return mx.where(mx.arange(logits.shape[-1]) == think_end, 0.0, -mx.inf)[None]
            return logits

    proc = ConstraintProcessor(compile_response_format(schema_format(schema)), tok,
                               after_think=True)
    gen = BatchGenerator(model, stop_tokens=[[i] for i in tok.eos_token_ids])
    (uid,) = gen.insert([prompt], max_tokens=[MAX_TOKENS],
                        logits_processors=[[ForceThinkEnd(), proc]])
    free = BatchGenerator(model, stop_tokens=[[i] for i in tok.eos_token_ids])
    (free_uid,) = free.insert([prompt], max_tokens=[6])
    out, finish = [], None
    while finish is None:
        for r in gen.next_generated():
            finish = r.finish_reason
            if finish != "stop":
                out.append(r.token)
    unconstrained = []
    while len(unconstrained) < 6:
        unconstrained += [r.token for r in free.next_generated()]
    gen.close()
    free.close()
    assert out[:6] == unconstrained  # thinking was left alone
    assert out[6] == think_end and finish == "stop" and proc.error is None
    jsonschema.validate(json.loads(tok.decode(out[7:])), schema, format_checker=FORMATS)


def test_a_refused_token_fails_only_the_request(qwen3):
    """A grammar error never raises: `error` is set and only EOS is allowed."""
    _, tok = qwen3
    proc = ConstraintProcessor(compile_response_format({"type": "json_object"}), tok)
    prompt = prompt_of(tok, "x")
    logits = mx.zeros((1, len(tok.vocab)))
    proc(mx.array(prompt), logits)
    bad = tok.encode("hello", add_special_tokens=False)[0]  # not '{'
    out = proc(mx.array(prompt + [bad]), logits)
    assert proc.error
    finite = mx.isfinite(out[0]).tolist()
    assert {i for i, f in enumerate(finite) if f} == set(tok.eos_token_ids)


def test_complete_grammar_allows_only_eos_and_wider_logits(qwen3):
    """After the grammar completes only EOS may follow; logits wider than the
    tokenizer's vocabulary (padded embeddings) never allow the extra ids."""
    _, tok = qwen3
    proc = ConstraintProcessor(compile_response_format(schema_format({"enum": ["red"]})), tok)
    prompt = prompt_of(tok, "x")
    vocab = len(tok.vocab) + 40
    logits = mx.zeros((1, vocab))
    first = proc(mx.array(prompt), logits)
    assert not mx.isfinite(first[0, len(tok.vocab):]).any().item()
    tokens = prompt + tok.encode('"red"', add_special_tokens=False)
    out = proc(mx.array(tokens), logits)
    finite = mx.isfinite(out[0]).tolist()
    assert {i for i, f in enumerate(finite) if f} == set(tok.eos_token_ids)
    assert proc.error is None


def test_mask_cost(qwen3):
    _, tok = qwen3
    for name, sample in SAMPLES.items():
        grammar = compile_response_format(schema_format(dict(SCHEMAS)[name]))
        cost = mask_cost(grammar, tok, json.dumps(sample))
        assert cost["tokens"] > 3 and 0 < cost["median_us"] < 5000, (name, cost)


def test_strict_tools_free_then_call_then_free(qwen3):
    """Strict tools, the model's choice: logits pass until <tool_call>, the
    call is held to its tool's schema, and after </tool_call> logits pass
    again (text or a second call); a call that breaks the schema fails."""
    _, tok = qwen3
    strict = [dict(t, function=dict(t["function"], strict=True)) for t in TOOLS]
    grammar = grammar_for(StrictToolCalls(strict), tok)
    prompt = prompt_of(tok, "x", tools=strict)
    logits = mx.zeros((1, len(tok.vocab)))

    def run(text):
        """(processor, per step: whether every id was allowed, all allowed)."""
        proc = ConstraintProcessor(grammar, tok, after_think=True, prompt=prompt)
        seq = list(prompt)
        out, free = proc(mx.array(seq), logits), []
        for t in tok.encode(text, add_special_tokens=False):
            finite = mx.isfinite(out[0])
            free.append(bool(finite.all().item()))
            if not finite[t].item():
                return proc, free, False
            seq.append(t)
            out = proc(mx.array(seq), logits)
        free.append(bool(mx.isfinite(out).all().item()))
        return proc, free, True

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    text = "Let me look. " + call + "\nDone."
    proc, free, ok = run(text)
    assert ok and proc.error is None
    n_text = len(tok.encode("Let me look. ", add_special_tokens=False))
    n_call = len(tok.encode(call, add_special_tokens=False))
    assert all(free[: n_text + 1])  # free until <tool_call> is written
    assert not any(free[n_text + 1 : n_text + n_call])  # the call: masked
    assert all(free[n_text + n_call :])  # free again after </tool_call>
    # Missing "unit": the schema refuses the closing brace.
    proc, _, ok = run('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert not ok
    assert StrictToolCalls.wanted(strict) and not StrictToolCalls.wanted(TOOLS)


def test_eos_only_rows_are_finite_whatever_the_logits(qwen3):
    """A finished or failed row samples EOS even when the logits (a logit_bias
    of -100, -inf) rule EOS out: never an all -inf row (NaN logprobs)."""
    _, tok = qwen3
    proc = ConstraintProcessor(compile_response_format({"type": "json_object"}), tok)
    prompt = prompt_of(tok, "x")
    logits = mx.zeros((1, len(tok.vocab)))
    for t in tok.eos_token_ids:
        logits[0, t] = -mx.inf
    proc(mx.array(prompt), logits)
    bad = tok.encode("hello", add_special_tokens=False)[0]
    out = proc(mx.array(prompt + [bad]), logits)  # refused: EOS only
    assert proc.error
    finite = mx.isfinite(out[0]).tolist()
    assert {i for i, f in enumerate(finite) if f} == set(tok.eos_token_ids)
    assert not mx.isnan(out - mx.logsumexp(out, axis=-1, keepdims=True)).any().item()


def _masks_along(grammar, tok, prompt, tokens, vocab):
    """The plain path: a processor fed `tokens` one a step (mask_batch),
    and the allowed ids ([vocab] bool, None: all) after each prefix."""
    proc = ConstraintProcessor(grammar, tok, after_think=True, prompt=prompt)
    history, masks = list(prompt), []
    for t in [None] + tokens:  # (None: the first step, its newest the prompt's last)
        newest = history[-1] if t is None else t
        if t is not None:
            history.append(t)
        mask = ConstraintProcessor.mask_batch([(0, proc, history[:-1], newest)], (1, vocab))
        masks.append(None if mask is None else mask.keep[0].copy())
    return masks


def _walked_text(kind, tok):
    """(grammar, prompt, the text's tokens then EOS) of free text around a
    strict tool call ("strict"), a schema's JSON ("schema") or a forced
    call ("forced")."""
    strict = [dict(t, function=dict(t["function"], strict=True)) for t in TOOLS]
    call = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>')
    if kind == "strict":
        grammar, text = grammar_for(StrictToolCalls(strict), tok), "Let me look. " + call + "\nDone."
        prompt = prompt_of(tok, "x", tools=strict)
    elif kind == "schema":
        grammar = compile_response_format(schema_format(dict(SCHEMAS)["nested_address"]))
        text = json.dumps(SAMPLES["nested_address"])
        prompt = prompt_of(tok, "x")
    else:
        grammar = tool_call_grammar(TOOLS, "get_weather", tokenizer=tok)
        text, prompt = call, prompt_of(tok, "x", tools=TOOLS)
    tokens = tok.encode(text, add_special_tokens=False) + [sorted(tok.eos_token_ids)[0]]
    return grammar, prompt, tokens


@pytest.mark.parametrize("kind", ["strict", "schema", "forced"])
def test_proposal_masks_are_the_masks_each_position_gets_and_change_nothing(qwen3, kind):
    """At every point of a text (free text, a strict tool call opened and
    closed, free text again; a schema's JSON; a forced call), proposal_masks
    of the next k tokens gives, for the first n, the masks a processor fed
    them one a step gives; n stops at a refused token, before the grammar
    completes, before a strict call opens or closes; the grammar is left as
    it was (the next step's mask is unchanged); ids past the tokenizer's
    cut the proposal without harming the row."""
    _, tok = qwen3
    vocab = 520  # (wider than the tokenizer: a draft's ids may run past it)
    grammar, prompt, tokens = _walked_text(kind, tok)
    want = _masks_along(grammar, tok, prompt, tokens, vocab)
    proc = ConstraintProcessor(grammar, tok, after_think=True, prompt=prompt)
    history, cuts = list(prompt), set()
    for at, t in enumerate([None] + tokens[:-1]):
        newest = history[-1] if t is None else t
        if t is not None:
            history.append(t)
        ConstraintProcessor.mask_batch([(0, proc, history[:-1], newest)], (1, vocab))
        ahead = tokens[at:at + 6]
        beyond = ahead[:2] + [tok.vocab_size + 3] + ahead[2:]
        for proposal in (ahead, beyond, ahead[:1] + [(ahead[1] + 7) % 400] + ahead[2:]
                         if len(ahead) > 1 else ahead):
            n, keep = proc.proposal_masks(proposal, vocab)
            assert n <= len(proposal) and proc.error is None, (kind, at)
            # (Compared while the proposal is the text: the plain path's masks
            # are the text's.)
            for j in range(n):
                if proposal[:j + 1] != ahead[:j + 1]:
                    break
                got = None if keep is None else keep[j]
                expected = want[at + j + 1]
                if expected is None:
                    assert got is None or got.all(), (kind, at, j)
                else:
                    assert got is not None and (got == expected).all(), (kind, at, j)
            if proposal is beyond and at + 2 < len(want) and want[at + 2] is not None:  # (cut)
                assert n <= 2, (kind, at, n)
            cuts.add(n < len(proposal))
    assert cuts == {True, False}
    # Left as it was: fed the rest one a step, the same masks as the plain path.
    assert proc.error is None and not proc.matcher.is_error()


@pytest.mark.parametrize("kind", ["strict", "schema", "forced"])
def test_a_draft_walk_gives_each_position_s_mask_and_changes_nothing(qwen3, kind):
    """At every point of a text, a draft's walk of the grammar (draft_walk)
    from the pending token along the next tokens gives, at each position,
    the mask a processor fed them one a step gives there, also where a
    check kept tokens the grammar has not read yet (in the row's KV, read
    at the next step: the walk takes them first); it stops where the
    grammar completes or a strict call closes, gives None while the model
    writes freely (strict tools before a call), and once closed leaves the
    grammar as it was (every step's mask the plain path's)."""
    _, tok = qwen3
    vocab = 520
    grammar, prompt, tokens = _walked_text(kind, tok)
    want = _masks_along(grammar, tok, prompt, tokens, vocab)
    proc = ConstraintProcessor(grammar, tok, after_think=True, prompt=prompt)
    history, walked, free, stops = list(prompt), 0, 0, 0
    for at, t in enumerate([None] + tokens[:-1]):
        newest = history[-1] if t is None else t
        if t is not None:
            history.append(t)
        mask = ConstraintProcessor.mask_batch([(0, proc, history[:-1], newest)], (1, vocab))
        got = None if mask is None else mask.keep[0]
        assert (got is None) == (want[at] is None) and (got is None or (got == want[at]).all())
        for kept in (0, 2):  # (tokens a check kept, in the KV, not read yet)
            walk = proc.draft_walk(vocab, history + tokens[at:at + kept])
            if walk is None:  # (free text, the grammar complete, or stopped by them)
                free += kept == 0 and want[at + 1] is None
                continue
            for j, token in enumerate(tokens[at + kept:at + kept + 6]):
                allowed = walk.after(token)
                k = at + kept + j + 1  # (tokens the grammar has taken, then)
                if allowed is None:
                    stops += 1
                    assert k == len(tokens) or want[k] is None or not want[k][token], \
                        (kind, at, kept, j)
                    break
                walked += kept > 0
                assert want[k] is not None and (allowed == want[k]).all(), (kind, at, kept, j)
            walk.close()
            assert proc.error is None and not proc.matcher.is_error()
    assert walked > 20 and stops > 0
    assert (free > 0) == (kind == "strict")
