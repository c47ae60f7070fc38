"""replay.py: sealed reasoning opens only as it was sealed, in this process,
and a replayed turn comes back into the prompt as the model wrote it."""

import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from mlx_lm_plus.protocols.replay import PREFIX, open_sealed, seal


@given(st.text())
def test_seal_opens_to_the_text(text):
    assert open_sealed(seal(text)) == text


def test_changed_or_foreign_values_do_not_open():
    sealed = seal("I should call the tool.")
    body, _, mac = sealed[len(PREFIX):].rpartition(".")
    other = seal("I should not.")[len(PREFIX):].rpartition(".")[0]
    for value in (PREFIX + other + "." + mac,  # another text, this mac
                  sealed[:-2], sealed + "A", PREFIX + body, PREFIX, "", None, 5, b"x",
                  PREFIX + "%%%." + mac, sealed.replace(PREFIX, "mlxp2.")):
        assert open_sealed(value) is None, value
    # Another process (another key) can't open it either.
    code = f"from mlx_lm_plus.protocols.replay import open_sealed; print(open_sealed({sealed!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "None", out.stderr


# A template that renders each assistant turn's reasoning back (as Qwen3.5's
# does after the last user message) and opens the think block.
KEEPS_REASONING = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + (m.reasoning_content or '') + '</think>'"
    " + (m.content or '') + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def thinking_server(fixture_path, fixture_dir, tmp_path_factory):
    from compat.launch import OURS, ServerProcess
    from testkit.fixtures import build_thinking_fixture

    model = build_thinking_fixture(fixture_dir, fixture_path("qwen3"))
    log = tmp_path_factory.mktemp("replay") / "server.log"
    with ServerProcess(OURS, ["--model", str(model), "--chat-template", KEEPS_REASONING],
                       log=log) as server:
        yield server


def test_a_replayed_responses_turn_reuses_what_the_server_wrote(thinking_server):
    """Codex's form (store: false, the reasoning item with only its
    encrypted_content): the reasoning goes back into the prompt token for
    token as generated, so the next request reuses the whole turn; a
    changed value drops the reasoning and the prompt departs right there."""
    first = {"model": "m", "input": "Sky?", "store": False, "max_output_tokens": 20,
             "include": ["reasoning.encrypted_content"]}
    status, r1 = thinking_server.post("/v1/responses", first)
    assert status == 200, r1
    reasoning, message = r1["output"]
    assert reasoning["content"][0]["text"] == "The sky is"
    assert message["content"][0]["text"] == "Done." and r1["status"] == "completed"
    seen = r1["usage"]["input_tokens"] + r1["usage"]["output_tokens"]
    cached = {}
    for label, sealed in (("sealed", reasoning["encrypted_content"]),
                          ("changed", reasoning["encrypted_content"][:-2] + "AA")):
        status, r2 = thinking_server.post("/v1/responses", {
            "model": "m", "store": False, "max_output_tokens": 4, "input": [
                {"role": "user", "content": "Sky?"},
                {"type": "reasoning", "summary": [], "encrypted_content": sealed},
                {"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": "Done."}]},
                {"role": "user", "content": "Why?"}]})
        assert status == 200, r2
        cached[label] = r2["usage"]["input_tokens_details"]["cached_tokens"]
    # Everything the server generated is reused (the last token, the EOS the
    # template writes as <|im_end|>, may be fed again).
    assert cached["sealed"] >= seen - 1, (cached, seen)
    assert cached["changed"] <= r1["usage"]["input_tokens"] + 1, (cached, seen)


def test_a_conversation_replayed_turn_after_turn(thinking_server):
    """Four turns in Codex's form, each replaying all the turns before:
    recomputed / novel = 1 (novel: the prompt past everything the server
    saw or wrote before)."""
    items, previous = [{"role": "user", "content": "Sky?"}], None
    for turn in range(4):
        status, r = thinking_server.post("/v1/responses", {
            "model": "m", "store": False, "include": ["reasoning.encrypted_content"],
            "input": items})
        assert status == 200, r
        usage = r["usage"]
        if previous is not None:
            novel = usage["input_tokens"] - previous
            recomputed = usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"]
            assert recomputed <= novel + 1, (turn, recomputed, novel)
        previous = usage["input_tokens"] + usage["output_tokens"]
        reasoning, message = r["output"]
        items += [{"type": "reasoning", "summary": [],
                   "encrypted_content": reasoning["encrypted_content"]},
                  {"type": "message", "role": "assistant", "content": [
                      {"type": "output_text", "text": message["content"][0]["text"]}]},
                  {"role": "user", "content": f"Why {turn}?"}]


def test_a_replayed_thinking_block_reuses_what_the_server_wrote(thinking_server):
    """Claude Code's form: the thinking block back with its signature."""
    user = {"role": "user", "content": "Sky?"}
    status, m1 = thinking_server.post("/v1/messages", {
        "model": "m", "max_tokens": 20, "messages": [user],
        "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert status == 200, m1
    thinking, text = m1["content"]
    # (signed by the server: another process, whose key this one has not)
    assert thinking["thinking"] == "The sky is" and thinking["signature"].startswith(PREFIX)
    assert text["text"] == "Done."
    usage = m1["usage"]
    seen = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["output_tokens"]
    status, m2 = thinking_server.post("/v1/messages", {
        "model": "m", "max_tokens": 4, "messages": [
            user, {"role": "assistant", "content": m1["content"]},
            {"role": "user", "content": "Why?"}]})
    assert status == 200, m2
    assert m2["usage"]["cache_read_input_tokens"] >= seen - 1, (m2["usage"], seen)
