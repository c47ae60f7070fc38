"""Greedy outputs with the prompt cache equal those without it, token for token.

On the attention (qwen3), hybrid (qwen3_5, mamba2) and sliding-window
(gemma3_text) fixtures, for the workloads the cache is for: multi-turn with
reasoning dropped by the template, divergent last user messages, regenerate,
edits of an earlier message, a system prompt shared by several conversations.
"""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_plus.cache.layers import compact
from testkit.engine_harness import SEQUENTIAL, EngineRunner

KINDS = ["qwen3", "qwen3_5", "mamba2", "gemma3_text", "nemotron_h"]
SYSTEM = ("You are a careful assistant for travel planning. Answer with short lists, "
          "name the cities, and count the days. ") * 3


def conversation(turns, tag="", edit_at=None, edit="changed"):
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        text = f"Turn {t}{tag}: plan day {t} by the river and the sea near city {t}."
        if edit_at == t:
            text = f"Turn {t}: {edit} plan for the mountain village instead."
        messages.append({"role": "user", "content": text})
        if t < turns - 1:
            messages.append({"role": "assistant",
                             "content": f"<think>day {t} thoughts</think>Day {t}: boat, bread."})
    return {"messages": messages}


def workload():
    yield "multi_turn", [conversation(t) for t in range(1, 9)]
    yield "divergent", [{"messages": [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"Question {i}: what to eat?"}]}
                        for i in range(4)]
    yield "regenerate", [conversation(6), conversation(6)]
    yield "edit_last", [conversation(6), conversation(6, edit_at=5), conversation(6, edit_at=5,
                                                                                edit="other")]
    yield "edit_earlier", [conversation(8), conversation(8, edit_at=4), conversation(8, edit_at=2)]


@pytest.fixture(scope="module", params=KINDS)
def runners(request, fixture_path):
    path = fixture_path(request.param)
    cached = EngineRunner(path)
    cold = EngineRunner(path, max_bytes=0)  # every insert is evicted: no reuse
    yield request.param, cached, cold
    cached.close()
    cold.close()


def test_cached_equals_cold(runners):
    kind, cached, cold = runners
    saved = 0
    for name, bodies in workload():
        for i, body in enumerate(bodies):
            tokens, prompt_len, hit = cached.run(body)
            cold_tokens, _, cold_hit = cold.run(body)
            assert cold_hit == 0
            assert tokens == cold_tokens, (kind, name, i)
            saved += hit
    assert saved > 0
    assert_store_invariant(cached)


def assert_store_invariant(runner):
    """Every stored entry holds exactly the state of its key's tokens."""
    model = runner.loaded.model
    for entry in runner.store.entries():
        fresh = make_prompt_cache(model)
        model(mx.array(list(entry.key))[None], cache=fresh)
        compact(fresh)
        for stored, ref in zip(runner.store.stored_cache(entry), fresh):
            if hasattr(ref, "max_size"):
                # Sliding window: a batch-extracted RotatingKVCache keeps the
                # window (plus a margin), a one-shot prefill keeps everything;
                # both attend the same way. The count must match.
                assert stored.offset == len(entry.key), (entry.kind, len(entry.key))
                continue
            if hasattr(ref, "offset"):
                assert stored.offset == ref.offset == len(entry.key)
            for a, b in zip(_arrays(stored.state), _arrays(ref.state)):
                assert a.shape == b.shape, (entry.kind, len(entry.key))
                assert mx.allclose(a, b, atol=1e-3, rtol=1e-3).item(), (entry.kind, len(entry.key))


def _arrays(state):
    out = []
    for s in state if isinstance(state, (list, tuple)) else [state]:
        if isinstance(s, (list, tuple)):
            out.extend(_arrays(s))
        elif isinstance(s, mx.array):
            out.append(s)
    return out


@pytest.mark.parametrize("kind", ["qwen3_5", "mamba2"])
def test_sequential_path_cached_equals_cold(kind, fixture_path):
    """The sequential path's checkpoints are exact too."""
    path = fixture_path(kind)
    cached, cold = EngineRunner(path), EngineRunner(path, max_bytes=0)
    try:
        hits = 0
        for name, bodies in workload():
            for i, body in enumerate(bodies):
                body = {**body, **SEQUENTIAL}
                tokens, _, hit = cached.run(body)
                assert tokens == cold.run(body)[0], (kind, name, i)
                hits += hit
        assert hits > 0 and cached.sequential == cold.sequential > 0
        assert_store_invariant(cached)
    finally:
        cached.close()
        cold.close()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "gemma3_text"])
def test_interleaved_and_concurrent_under_a_tight_budget(kind, fixture_path):
    """Three conversations, each turn's three requests sent at once (one
    batch), in a budget that holds about one conversation: entries and the
    attention KV of the edges they shared are evicted while others still
    pass there. Outputs equal cold ones, the cache still hits, and every
    entry left holds exactly its key's state."""
    path = fixture_path(kind)
    cached, cold = EngineRunner(path, max_bytes=600_000), EngineRunner(path, max_bytes=0)
    try:
        hits = 0
        for t in range(1, 5):
            bodies = [conversation(t, tag=f" of trip {c}") for c in range(3)]
            got = [cached.submit(b).result() for b in bodies] if t % 2 else [
                c.result() for c in [cached.submit(b) for b in bodies]]
            for c, (tokens, ctx) in enumerate(got):
                assert tokens == cold.run(bodies[c])[0], (kind, t, c)
                hits += ctx.prompt_cache_count > 0
        snap = cached.store.snapshot()
        counted = cached.store.recount()
        assert hits > 0 and snap["evictions"] > 0, snap
        assert counted["kv_bytes"] == cached.store.kv_bytes and counted["spans_cover_edges"]
        assert cached.store.nbytes <= 600_000
        assert_store_invariant(cached)
    finally:
        cached.close()
        cold.close()


def test_draft_model_entries_are_cut_to_the_tokens_they_hold(fixture_path):
    """Speculative decoding leaves the model's and the draft's caches behind
    the key by different counts: stored cut to the shortest, a repeat and a
    next turn hit the cache and equal a cache-off run."""
    path = str(fixture_path("llama"))
    argv = ["--draft-model", path]
    cached = EngineRunner(path, argv=argv)
    cold = EngineRunner(path, max_bytes=0, argv=argv)
    try:
        first = conversation(2)
        assert cached.run(first)[0] == cold.run(first)[0]
        for body in (first, conversation(3)):
            tokens, _, hit = cached.run(body)
            assert hit > 0 and tokens == cold.run(body)[0]
        assert cached.store.stats["not_stored"] == 0
        assert_store_invariant(cached)
    finally:
        cached.close()
        cold.close()


@pytest.mark.parametrize("kind", ["qwen3_5", "mamba2"])
def test_a_conversation_keeps_one_state_per_turn(kind, fixture_path):
    """A chat client's conversation, its replies sent back with their
    reasoning dropped by the template: each turn resumes from the previous
    turn's prompt entry (all but the prompt's last token and the re-rendered
    reply cached), and what stays is one state per turn: the system prompt,
    the boundary at the start of each later user message, the latest
    prompt and its reply. No divergence checkpoint inside an abandoned
    reply, no past turn's prompt entry. Replies equal cold ones."""
    runner = EngineRunner(fixture_path(kind))
    cold = EngineRunner(fixture_path(kind), max_bytes=0)
    try:
        messages = [{"role": "system", "content": SYSTEM}]
        previous = 0
        for t in range(6):
            messages.append({"role": "user", "content": f"Turn {t}: plan day {t} by the sea."})
            body = {"messages": messages, "max_tokens": 8}
            tokens, prompt, cached = runner.run(body)
            assert tokens == cold.run(body)[0]
            if t:
                assert previous - 1 <= cached < prompt
            previous = prompt
            text = runner.loaded.tokenizer.decode(tokens)
            messages.append({"role": "assistant", "content": f"<think>hm</think>{text}"})
        kinds = sorted(e.kind for e in runner.store.entries())
        assert kinds == ["checkpoint"] * 5 + ["generated", "prompt", "system"], kinds
        assert runner.store.stats["passed"] == 5
    finally:
        runner.close()
        cold.close()


@pytest.mark.parametrize("kind,seed,draft", [("qwen3", 3, False), ("qwen3", None, False),
                                             ("qwen3", 3, True)])
def test_penalties_count_the_whole_prompt_cached_or_cold(kind, seed, draft, fixture_path):
    """Repetition and presence penalties look back over the prompt too. On
    the sequential path (SEQUENTIAL) mlx-lm's generate_step hands the
    processors only the prompt it is given: the part not cached (nor
    prefilled to a checkpoint); with a draft model, none of it. Cached and
    cold must still agree."""
    path = fixture_path(kind)
    argv = ["--draft-model", str(path)] if draft else []
    cached, cold = EngineRunner(path, argv=argv), EngineRunner(path, max_bytes=0, argv=argv)
    vocab_text = cached.loaded.tokenizer.decode(list(range(7, 400)))  # most tokens once
    try:
        for penalty in ({"presence_penalty": 5.0, "presence_context_size": 2000},
                        {"repetition_penalty": 3.0, "repetition_context_size": 2000}):
            body = {"messages": [{"role": "system", "content": vocab_text},
                                 {"role": "user", "content": "Plan a day by the river."}],
                    "max_tokens": 8, **penalty, **(SEQUENTIAL if seed is not None else {})}
            for turn in range(2):
                tokens, _, hit = cached.run(body)
                assert tokens == cold.run(body)[0], (penalty, turn, hit)
            assert hit > 0
    finally:
        cached.close()
        cold.close()
