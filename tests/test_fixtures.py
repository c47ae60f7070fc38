"""The fixture models load, template, and are sensitive enough for exact tests."""

import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, stream_generate

from testkit.fixtures import FIXTURE_KINDS, PIPELINE_KINDS, SPECIAL_TOKENS

SYSTEM = "You are a helpful assistant. Answer briefly and clearly, with care."
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module", params=FIXTURE_KINDS + PIPELINE_KINDS)
def loaded(request, fixture_path):
    model, tokenizer = load(str(fixture_path(request.param)))
    return request.param, model, tokenizer


def greedy(model, tokenizer, prompt, n):
    return [g.token for g in stream_generate(model, tokenizer, prompt, max_tokens=n)]


def long_prompt(tokenizer):
    messages = [{"role": "system", "content": SYSTEM}]
    for i in range(4):
        messages.append({"role": "user", "content": f"Question {i}: tell me about the river "
                         f"and the boat in the morning, then count to {i + 3}."})
        messages.append({"role": "assistant", "content": f"<think>hmm {i}</think>The boat is "
                         f"on the river number {i}."})
    messages.append({"role": "user", "content": "Now describe the mountain village."})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_tokenizer_and_template(loaded):
    kind, model, tok = loaded
    assert tok.has_thinking and tok.has_tool_calling
    assert tok.tool_parser is not None
    assert tok.eos_token_ids == {tok.convert_tokens_to_ids("<|im_end|>")}
    text = "Hello, world: 12345 ü!\n{\"a\": 1}"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    shapes = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
         {"role": "user", "content": "again"}],
        [{"role": "user", "content": "w?"}, {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
         {"role": "tool", "content": "sunny"}],
    ]
    for messages in shapes:
        rendered = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                           tokenize=False)
        assert rendered.endswith("<|im_start|>assistant\n")
    off = tok.apply_chat_template(shapes[0], add_generation_prompt=True, tokenize=False,
                                  enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")
    # Earlier thinking is dropped by the template.
    history = tok.apply_chat_template([
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>y"},
        {"role": "user", "content": "b"}], tokenize=False)
    assert "<think>" not in history and "y<|im_end|>" in history


def test_no_special_tokens_and_some_variety(loaded):
    kind, model, tok = loaded
    out = greedy(model, tok, long_prompt(tok), 32)
    special = {tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert len(out) == 32 and not special & set(out)
    assert len(set(out)) >= 4, out


def test_dropping_one_prompt_token_changes_the_output(loaded):
    kind, model, tok = loaded
    prompt = long_prompt(tok)
    assert 150 < len(prompt) < 400
    base = greedy(model, tok, prompt, 8)
    positions = [int(len(prompt) * f) for f in (0.05, 0.15, 0.3, 0.45, 0.6, 0.75, 0.85, 0.95)]
    changed = sum(greedy(model, tok, prompt[:i] + prompt[i + 1:], 8) != base for i in positions)
    assert changed >= 7, (kind, changed)


def test_batched_equals_single(loaded):
    kind, model, tok = loaded
    base = long_prompt(tok)
    prompts = [base[:60], base, base[:130]]
    singles = [greedy(model, tok, p, 8) for p in prompts]
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    uids = gen.insert(prompts, max_tokens=[8] * 3)
    out = {u: [] for u in uids}
    while any(len(v) < 8 for v in out.values()):
        for r in gen.next_generated():
            out[r.uid].append(r.token)
    gen.close()
    assert [out[u] for u in uids] == singles, kind
