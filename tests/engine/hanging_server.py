"""mlx_lm_plus.server whose batch step hangs (an MLX call that never
returns) once a request asks for it with "HANG" in its last message, or
hangs admitting a request that says "HANG_ADMIT", or planning one that says
"HANG_PLAN": for the watchdog tests, which need a real process to exit."""

import sys
import time

from mlx_lm_plus.engine import engine, planner
from mlx_lm_plus.server import main

_prepare, _step = engine.prepare, engine._Batch.step
_build_plan = planner.Planner.build
hang = []


def build_plan(self, lm, request, args):
    text = str(request.messages[-1].get("content")) if request.messages else ""
    if "HANG_PLAN" in text:  # a template that never finishes, say
        time.sleep(3600)
    return _build_plan(self, lm, request, args)


def prepare(self, lm, channel, request, args, *rest, **kw):
    text = str(request.messages[-1].get("content")) if request.messages else ""
    if "HANG_ADMIT" in text:  # stuck while the request is being admitted
        time.sleep(3600)
    if "HANG" in text:
        hang.append(True)
    return _prepare(self, lm, channel, request, args, *rest, **kw)


def step(self):
    if hang:
        time.sleep(3600)
    return _step(self)


engine.prepare, engine._Batch.step = prepare, step
planner.Planner.build = build_plan

if __name__ == "__main__":
    main(sys.argv[1:])
