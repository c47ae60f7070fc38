"""The fuzzer, short form: a few hundred hypothesis-generated requests for
every endpoint against one live server (the long form is
`python -m benchmarks.fuzz --examples 5000`).

Every answer is a well-formed JSON 2xx/4xx (an SSE stream for a 200 stream),
/health stays 200 after each request, and fixed greedy requests get their
first answer again after every batch (benchmarks/fuzz.py has the oracle).
The run is seeded, so a failure comes back the same way; it is reported with
the smallest body that showed it, shrunk. The embedding endpoints get their
own server (a chat model, an embedder and a reranker), their corpus first,
then 600 generated bodies.
"""

import pytest

from benchmarks.fuzz import (
    Context, Fuzzer, corpus_cases, embedding_cases, run, server_for,
)
from testkit.bad_input import EMBEDDING_SERVED, models_config_file

EXAMPLES = 300
EMBEDDING_EXAMPLES = 600


@pytest.fixture(scope="module", params=[([], 20261123), (["--allow-model-loading"], 20261124)],
                ids=["default", "allow-model-loading"])
def fuzz_server(request, fixture_path, tmp_path_factory):
    flags, seed = request.param
    model = str(fixture_path("qwen3"))
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    with server_for(model, log, flags) as server:
        yield server, model, seed


def test_fuzz_every_endpoint(fuzz_server):
    server, model, seed = fuzz_server
    fuzzer = Fuzzer(server, log=print)
    fuzzer.start()
    run(fuzzer, EXAMPLES, seed=seed, ctx=Context(model=model))
    fuzzer.finish()
    if fuzzer.failures:
        fuzzer.shrink_all(seconds_each=10, total=40)
    report = fuzzer.report()
    print(report)
    assert fuzzer.tried >= EXAMPLES
    # The generator reaches generation, not only validation errors.
    assert sum(c["2xx"] for e, c in fuzzer.per_endpoint.items() if "completions" in e) >= 50
    if fuzzer.failures or fuzzer.health_failures or fuzzer.canary_failures:
        pytest.fail(report, pytrace=False)


@pytest.fixture(scope="module")
def embedding_server(fixture_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-embeddings")
    config = models_config_file(fixture_path, root)
    with server_for(None, root / "server.log", models_config=config) as server:
        yield server, str(fixture_path(EMBEDDING_SERVED["chat"]))


def test_fuzz_embeddings_and_rerank(embedding_server):
    """testkit/bad_input.py's embedding corpus, then generated bodies for
    /v1/embeddings and the rerank paths (and completions naming the
    embedders); the canaries include an embeddings and a rerank request.
    (No schema floods: the other test has them.)"""
    server, model = embedding_server
    fuzzer = Fuzzer(server, log=print, flood_every=0, embeddings=True)
    fuzzer.start()
    corpus = corpus_cases(("embeddings",))
    for case in corpus:
        fuzzer.try_case(case)
    ctx = Context(model=model, embeddings=True)
    run(fuzzer, EMBEDDING_EXAMPLES, seed=20261125, ctx=ctx, strategy=embedding_cases(ctx))
    fuzzer.finish()
    if fuzzer.failures:
        fuzzer.shrink_all(seconds_each=10, total=40)
    report = fuzzer.report()
    print(report)
    assert fuzzer.tried >= EMBEDDING_EXAMPLES + len(corpus)
    # The generator reaches the models, not only validation errors.
    ok = {e: c["2xx"] for e, c in fuzzer.per_endpoint.items()}
    assert ok.get("POST /v1/embeddings [json]", 0) >= 20, ok
    assert sum(n for e, n in ok.items() if "rerank" in e) >= 20, ok
    if fuzzer.failures or fuzzer.health_failures or fuzzer.canary_failures:
        pytest.fail(report, pytrace=False)
