"""Several models in one server: the served set, /v1/models, residency (LRU,
--max-loaded-models, pinning, TTL, keep_alive), per-model defaults, and the
same texts as one-model servers."""

import http.client
import json
import threading
import time
from argparse import Namespace

import pytest
from mlx_lm.server import ModelDescription

from compat.launch import OURS, ServerProcess, parse_sse
from mlx_lm_plus.models.provider import ModelProvider
from mlx_lm_plus.models.served import read_models_config
from mlx_lm_plus.config import parse_args

KINDS = {"alpha": "qwen3", "beta": "llama", "gamma": "qwen3_5"}
SYSTEM = "You are a helpful assistant. Answer briefly and clearly, in plain words."


def messages(text):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def body(model, text, max_tokens=12, **kw):
    return {"model": model, "messages": messages(text), "max_tokens": max_tokens, **kw}


def chat(server, b):
    status, r = server.post("/v1/chat/completions", b)
    assert status == 200, r
    return r


def text_of(r):
    return r["choices"][0]["message"]["content"]


def loaded(server):
    status, models = server.get("/v1/models")
    assert status == 200
    return {m["id"]: m["loaded"] for m in models["data"]}


def wait_for(predicate, timeout=30):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def paths(fixture_path):
    return {name: str(fixture_path(kind)) for name, kind in KINDS.items()}


@pytest.fixture(scope="module")
def reference(paths, tmp_path_factory):
    """Texts from one-model servers, one per model (started one at a time)."""
    logs = tmp_path_factory.mktemp("reference")

    def run(name, bodies):
        with ServerProcess(OURS, ["--model", paths[name]], log=logs / f"{name}.log") as s:
            return [text_of(chat(s, {**b, "model": "default_model"})) for b in bodies]

    return run


def write_config(path, entries):
    path.write_text(json.dumps({"models": entries}))
    return str(path)


@pytest.fixture(scope="module")
def multi(paths, tmp_path_factory):
    """--model alpha (pinned default) and a config with beta and gamma, at
    most two loaded."""
    root = tmp_path_factory.mktemp("multi")
    config = write_config(root / "models.json", [
        {"name": "beta", "path": paths["beta"], "aliases": ["gpt-4o-mini"],
         "defaults": {"max_tokens": 7}},
        {"name": "gamma", "path": paths["gamma"]},
    ])
    args = ["--model", paths["alpha"], "--models-config", config, "--max-loaded-models", "2"]
    with ServerProcess(OURS, args, log=root / "server.log") as s:
        yield s


def test_served_set_names_and_defaults(tmp_path, paths):
    config = write_config(tmp_path / "m.json", [
        {"name": "beta", "path": paths["beta"], "aliases": ["gpt-4o-mini"], "pinned": True,
         "ttl": 5, "defaults": {"temperature": 0.5, "max_tokens": 9}}])
    provider = ModelProvider(parse_args(["--model", paths["alpha"], "--model", paths["gamma"],
                                         "--models-config", config]))
    key = provider.key_for
    alpha = (paths["alpha"], None, None)
    assert key(ModelDescription("default_model", "default_model", None)) == alpha
    assert key(ModelDescription(paths["alpha"], "default_model", None)) == alpha
    assert key(ModelDescription("gpt-4o-mini", "default_model", None)) == (paths["beta"], None,
                                                                           None)
    assert [e.name for e in provider.served][2] == "beta"
    assert [e.pinned for e in provider.served] == [True, False, True]
    assert provider.served[2].ttl == 5
    assert not provider.is_served(ModelDescription("nope", "default_model", None))
    cli = provider.defaults_for("gpt-4o-mini")
    assert (cli.temp, cli.max_tokens) == (0.5, 9)
    assert provider.defaults_for("default_model") is provider.cli_args
    for bad in ({"path": 3}, {"path": "x", "color": 1}, {"path": "x", "defaults": {"seed": 1}},
                {"path": "x", "aliases": "y"}):
        (tmp_path / "bad.json").write_text(json.dumps({"models": [bad]}))
        with pytest.raises(ValueError):
            read_models_config(tmp_path / "bad.json")


def test_frontend_sequence(multi, reference):
    """List the models, pick each in turn, chat, switch back: every request
    succeeds with the text a one-model server gives, at most two models are
    loaded, and the switch back hits the prompt cache."""
    # (The default model loads at the start, /health answers meanwhile.)
    wait_for(lambda: multi.get("/v1/models")[1]["data"][0]["loaded"])
    models = multi.get("/v1/models")[1]["data"]
    ids = [m["id"] for m in models]
    assert ids[1:] == ["beta", "gamma"] and ids[0].endswith("qwen3")
    assert [(m["loaded"], m["pinned"]) for m in models] == [(True, True), (False, False),
                                                          (False, False)]
    alpha = ids[0]
    questions = {"alpha": "Tell me about the river.", "beta": "Name a big city.",
                 "gamma": "Describe the weather."}
    texts = {}
    for name in ("alpha", "beta", "gamma"):
        model = alpha if name == "alpha" else name
        r = chat(multi, body(model, questions[name]))
        texts[name] = text_of(r)
        assert r["model"] == model
        state = loaded(multi)
        assert sum(state.values()) <= 2 and state[model] and state[alpha]
    assert loaded(multi) == {alpha: True, "beta": False, "gamma": True}
    for name in texts:
        assert reference(name, [body("x", questions[name])]) == [texts[name]], name

    # Back to beta: gamma makes room (alpha is pinned); beta's cache survived.
    history = messages(questions["beta"]) + [
        {"role": "assistant", "content": texts["beta"]},
        {"role": "user", "content": "And a small one?"}]
    r = chat(multi, {"model": "beta", "messages": history, "max_tokens": 12})
    assert loaded(multi) == {alpha: True, "beta": True, "gamma": False}
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 20
    assert reference("beta", [{"messages": history, "max_tokens": 12}]) == [text_of(r)]

    status, r = multi.post("/v1/chat/completions", body("nope", "hi"))
    assert status == 404 and "beta" in r["error"]


def test_alias_and_per_model_defaults(multi):
    r = chat(multi, {"model": "gpt-4o-mini", "messages": messages("Count to ten.")})
    assert r["usage"]["completion_tokens"] <= 7  # beta's default max_tokens
    assert r["model"] == "gpt-4o-mini"


def test_concurrent_requests_for_three_models(multi, reference):
    """Requests for three models at once with room for two: each waits its
    turn (the third model loads once one of the others is idle) and gets a
    one-model server's text."""
    alpha = multi.get("/v1/models")[1]["data"][0]["id"]
    jobs = [(name, f"Question {i} about the sea and the boat.")
            for i in range(2) for name in ("alpha", "beta", "gamma")]
    results = {}

    def run(i, name, text):
        model = alpha if name == "alpha" else name
        results[i] = text_of(chat(multi, body(model, text, max_tokens=10)))

    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(results) == len(jobs)
    for name in KINDS:
        mine = [i for i, job in enumerate(jobs) if job[0] == name]
        expected = reference(name, [body("x", jobs[i][1], max_tokens=10) for i in mine])
        assert [results[i] for i in mine] == expected, name


def stream_tokens(server, b):
    """Stream a chat completion; returns (text, time the stream ended)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps({**b, "stream": True}),
                 {"Content-Type": "application/json"})
    data = conn.getresponse().read()
    ended = time.monotonic()
    text = "".join(e[1]["choices"][0]["delta"].get("content") or ""
                   for e in parse_sse(data) if e[0] == "data" and e[1] != "[DONE]"
                   and e[1]["choices"])
    return text, ended


def test_a_model_with_running_requests_is_never_unloaded(multi, reference):
    """beta streams a long answer; gamma is asked for meanwhile. The only
    model that could make room is beta: gamma waits until beta's stream has
    ended, and beta's answer is whole. Requests for the pinned default go
    on meanwhile (they can't be what makes room)."""
    alpha = multi.get("/v1/models")[1]["data"][0]["id"]
    chat(multi, body("beta", "warm up", max_tokens=2))
    long = body("beta", "Write a long story about a village.", max_tokens=1500,
                logit_bias={"0": -100, "1": -100, "2": -100})  # (no end of text)
    out = {}
    streamer = threading.Thread(target=lambda: out.update(beta=stream_tokens(multi, long)))
    streamer.start()
    wait_for(lambda: any(m["id"] == "beta" and m["active_requests"]
                         for m in multi.get("/v1/stats")[1]["models"]))
    waiter = threading.Thread(target=lambda: out.update(gamma=(
        chat(multi, body("gamma", "Describe the weather.", max_tokens=4)), time.monotonic())))
    gamma_sent = time.monotonic()
    waiter.start()
    time.sleep(0.2)
    chat(multi, body(alpha, "Meanwhile, hi.", max_tokens=4))
    alpha_done = time.monotonic()
    streamer.join(300)
    waiter.join(300)
    text, beta_done = out["beta"]
    r, gamma_done = out["gamma"]
    assert gamma_sent < alpha_done < beta_done <= gamma_done
    assert r["choices"][0]["message"]["content"] is not None
    assert reference("beta", [long]) == [text]


def test_lru_ttl_and_keep_alive(paths, tmp_path):
    """No pinned model, two loaded at most: the least recently used idle one
    goes. Then --model-ttl unloads idle models; keep_alive -1 keeps one past
    it, keep_alive 0 unloads at once. Served from --models-dir."""
    root = tmp_path / "models"
    root.mkdir()
    for name, path in paths.items():
        (root / name).symlink_to(path)
    (root / "zbroken").mkdir()  # a folder that fails to load
    (root / "zbroken" / "config.json").write_text("{}")
    args = ["--models-dir", str(root), "--max-loaded-models", "2", "--model-ttl", "3"]
    with ServerProcess(OURS, args, log=tmp_path / "server.log") as s:
        assert [m["id"] for m in s.get("/v1/models")[1]["data"]] == ["alpha", "beta", "gamma",
                                                                      "zbroken"]
        status, r = s.post("/v1/chat/completions", body("zbroken", "hi"))
        assert status == 404 and "zbroken" in r["error"], r
        chat(s, body("alpha", "hi", max_tokens=2))  # (the default: loaded at the start)
        chat(s, body("beta", "hi", max_tokens=2))
        chat(s, body("alpha", "again", max_tokens=2))  # beta is now the least recent
        chat(s, body("gamma", "hi", max_tokens=2))
        assert loaded(s) == {"alpha": True, "beta": False, "gamma": True, "zbroken": False}

        chat(s, body("alpha", "stay", max_tokens=2, keep_alive=-1))
        chat(s, body("gamma", "go", max_tokens=2, keep_alive=0))
        wait_for(lambda: not loaded(s)["gamma"], timeout=2)  # at once, not after the TTL
        chat(s, body("beta", "hi", max_tokens=2))
        wait_for(lambda: not loaded(s)["beta"], timeout=30)  # the TTL
        time.sleep(1)
        assert loaded(s) == {"alpha": True, "beta": False, "gamma": False, "zbroken": False}
        # /metrics: per-model gauges and counters.
        status, _, metrics = s.request("GET", "/metrics")
        metrics = metrics.decode()
        assert 'mlx_lm_plus_model_loaded{model="alpha"} 1.0' in metrics
        assert 'mlx_lm_plus_model_loaded{model="beta"} 0.0' in metrics
        assert 'mlx_lm_plus_model_requests_total{model="beta",status="200"} 2.0' in metrics
        assert "mlx_lm_plus_model_unloads_total 3.0" in metrics


def test_bad_keep_alive_is_a_400(multi):
    status, r = multi.post("/v1/chat/completions", body("beta", "hi", keep_alive="soon"))
    assert status == 400 and "keep_alive" in r["error"]


def test_pinned_models_filling_every_slot_answer_instead_of_waiting(paths, tmp_path):
    """--max-loaded-models 1 with the default model pinned: another served
    model can never load; its request is answered with why, at once."""
    config = write_config(tmp_path / "m.json", [{"name": "beta", "path": paths["beta"]}])
    args = ["--model", paths["alpha"], "--models-config", config, "--max-loaded-models", "1"]
    with ServerProcess(OURS, args, log=tmp_path / "server.log") as s:
        status, r = s.post("/v1/chat/completions", body("beta", "hi"))
        assert status == 404 and "pinned" in r["error"], r
        assert chat(s, body("default_model", "hi", max_tokens=2))["choices"]


def test_loaded_model_is_what_upstreams_provider_loads(paths):
    """LoadedModel loads text models with its own copy of upstream's
    ModelProvider._load (without its gc.collect): the same model, tokenizer
    and flags as upstream's, with and without a draft model (where
    upstream's is never batchable: here its draft proposes in the batch,
    the engine's facts decide, engine/drafting.py)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.server import ModelProvider as Upstream

    from mlx_lm_plus.models.provider import LoadedModel

    for key in ((paths["alpha"], None, None), (paths["alpha"], None, paths["alpha"])):
        args = parse_args(["--model", key[0], "--use-default-chat-template"])
        ours, theirs = LoadedModel(args, key), Upstream(args)
        theirs.load(*key)
        assert (ours.model_key, ours.processor) == (theirs.model_key, theirs.processor)
        assert theirs.is_batchable == (key[2] is None) and ours.is_batchable
        assert type(ours.model) is type(theirs.model)
        assert ours.tokenizer.chat_template == theirs.tokenizer.chat_template
        assert type(ours.draft_model) is type(theirs.draft_model)
        for (k, a), (k2, b) in zip(tree_flatten(ours.model.parameters()),
                                   tree_flatten(theirs.model.parameters())):
            assert k == k2 and mx.array_equal(a, b)
        assert ours.nbytes >= sum(v.nbytes for _, v in tree_flatten(ours.model.parameters()))


def test_vision_and_text_models_side_by_side(fixture_path, tmp_path):
    """A text default and a vision model loaded on request (on the loader
    thread): image requests to the vision model work, and its second turn
    reuses the image prefix."""
    from tests.models.test_vision import png

    config = write_config(tmp_path / "m.json",
                          [{"name": "vl", "path": str(fixture_path("qwen2_vl"))}])
    args = ["--model", str(fixture_path("qwen3")), "--models-config", config]
    image = {"type": "image_url", "image_url": {"url": png((200, 30, 30))}}
    turn = [{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}]
    with ServerProcess(OURS, args, log=tmp_path / "server.log") as s:
        first = chat(s, {"model": "vl", "messages": turn, "max_tokens": 5})
        assert chat(s, body("default_model", "hi", max_tokens=3))["choices"]
        again = chat(s, {"model": "vl", "messages": turn, "max_tokens": 5})
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
            first["usage"]["prompt_tokens"] - 1
        assert text_of(again) == text_of(first)
        assert s.get("/v1/stats")[1]["engine"]["vision"]["images_from_cache"] == 1


def test_engine_checks_the_vocabulary_of_a_model_it_loads_for_the_request(paths, monkeypatch):
    """A request for a model not loaded yet whose vocabulary could not be
    read before it was queued (vocab_size None here) is checked by the
    engine once the model is loaded: 400, where an id past the vocabulary
    would be written out of bounds. A request that waits KEEPALIVE_EVERY
    gets a keepalive (a stream: its headers), a shorter wait none (its
    status code stays its own)."""
    from mlx_lm_plus.engine import housekeeping
    from mlx_lm_plus.errors import PromptError
    from mlx_lm_plus.protocols.validation import parse_request
    from testkit.engine_harness import Collect, EngineRunner

    monkeypatch.setattr(housekeeping, "KEEPALIVE_EVERY", 0.3)
    runner = EngineRunner(paths["alpha"], argv=["--model", paths["beta"]])
    load = runner.provider.load

    def slow_load(key):
        time.sleep(1.0)
        return load(key)

    try:
        runner.loaded  # (the default, loaded at the start)
        monkeypatch.setattr(runner.provider, "load", slow_load)
        request = {"model": paths["beta"], "messages": messages("hi"), "max_tokens": 3}
        for i, (extra, error) in enumerate((({"logit_bias": {"1000000000": 5}}, "logit_bias"),
                                            ({"top_k": 100000}, "top_k"), ({}, None))):
            parsed = parse_request("/v1/chat/completions", {**request, **extra}, runner.args,
                                   vocab_size=None)
            channel = Collect()
            runner.engine.submit(channel, parsed.request, parsed.args)
            if i == 0:  # set aside while beta loads (1 s)
                assert channel.items.get(timeout=60) == (0, 0)
            if error is None:
                assert len(channel.result()[0]) == 3
            else:
                with pytest.raises(PromptError, match=error):
                    channel.result()
        # A short wait (a fast load): no keepalive.
        monkeypatch.setattr(runner.provider, "load", load)
        channel = runner.submit({"model": paths["gamma"], "messages": messages("hi")})
        assert not isinstance(channel.items.get(timeout=60), tuple)
    finally:
        runner.close()


def test_a_stuck_load_is_given_up(paths, monkeypatch):
    """A load that doesn't end (a stalled disk or download) would hold every
    later load back: after --model-load-timeout its requests get 404 and the
    next load runs on a new loader thread; the server stays healthy."""
    from mlx_lm_plus.errors import ModelLoadError
    from testkit.engine_harness import EngineRunner

    runner = EngineRunner(paths["alpha"], argv=["--model", paths["beta"],
                                                "--model-load-timeout", "1"])
    load = runner.provider.load
    try:
        runner.loaded
        monkeypatch.setattr(runner.provider, "load",
                            lambda key: time.sleep(20) if key[0] == paths["beta"] else load(key))
        waiting = runner.submit({"model": paths["beta"], "messages": messages("hi")})
        with pytest.raises(ModelLoadError, match="model-load-timeout"):
            waiting.result(timeout=20)
        assert runner.engine.is_healthy
        monkeypatch.setattr(runner.provider, "load", load)
        assert len(runner.run({"model": paths["beta"], "messages": messages("hi"),
                               "max_tokens": 3})[0]) == 3
    finally:
        runner.close()


def test_an_unloaded_model_is_freed(paths):
    """keep_alive 0 unloads beta once its request is done, and nothing keeps
    its weights alive (no reference cycles, no gc.collect needed)."""
    import weakref

    from testkit.engine_harness import EngineRunner

    runner = EngineRunner(paths["alpha"], argv=["--model", paths["beta"]])
    beta = (paths["beta"], None, None)
    try:
        runner.loaded
        channel = runner.submit({"model": paths["beta"], "messages": messages("hi"),
                                 "keep_alive": 0, "max_tokens": 400,
                                 "logit_bias": {"0": -100, "1": -100, "2": -100}})
        wait_for(lambda: runner.provider.get(beta) is not None)
        weights = weakref.ref(runner.provider.get(beta).model)
        assert len(channel.result()[0]) == 400  # (it ran while beta was held)
        wait_for(lambda: runner.provider.get(beta) is None)
        wait_for(lambda: weights() is None, timeout=5)
    finally:
        runner.close()


def test_a_first_folder_that_fails_to_load_leaves_the_others_served(paths, tmp_path):
    """--models-dir with no --model: the first folder is the default, loaded
    at the start. One that fails to load crashed the generation loop at
    each restart, then kept it down: every model answered 503."""
    root = tmp_path / "models"
    root.mkdir()
    (root / "abroken").mkdir()  # first in order: the default
    (root / "abroken" / "config.json").write_text("{}")
    (root / "good").symlink_to(paths["alpha"])
    with ServerProcess(OURS, ["--models-dir", str(root)], log=tmp_path / "server.log") as s:
        assert s.get("/health") == (200, {"status": "ok"})
        chat(s, body("good", "hi", max_tokens=2))
        status, r = s.post("/v1/chat/completions", body("abroken", "hi"))
        assert 400 <= status < 600 and status != 503 and "abroken" in r["error"], (status, r)
        assert s.get("/health") == (200, {"status": "ok"})
