"""What the tests, the benchmarks and the compat suite share: not part of the
installed package (pyproject.toml installs `mlx_lm_plus*` only), imported
from the repository root (`python -m pytest`, `python -m benchmarks ...`,
`python -m compat.run`).

    fixtures.py        tiny random-weight model folders, built offline in seconds
    engine_harness.py  the engine in-process, without HTTP (EngineRunner)
    netns.py           hosts on one Linux machine: network namespaces, ranks over ring
    schema_corpus.py   JSON schemas for the constraint engine
    browser.py         headless Chromium over the DevTools protocol
    bad_input.py       bad requests for every protocol, each a 4xx (CASES, ...)

Nothing here imports `tests`.
"""
