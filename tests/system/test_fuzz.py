"""The fuzzer, short form: a few hundred hypothesis-generated requests for
every endpoint against one live server (the long form is
`python -m benchmarks.fuzz --examples 5000`).

Every answer is a well-formed JSON 2xx/4xx (an SSE stream for a 200 stream),
/health stays 200 after each request, and fixed greedy requests get their
first answer again after every batch (benchmarks/fuzz.py has the oracle).
The run is seeded, so a failure comes back the same way; it is reported with
the smallest body that showed it, shrunk.
"""

import pytest

from benchmarks.fuzz import Context, Fuzzer, run, server_for

EXAMPLES = 300


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
