"""mlx_lm_plus.server whose batch step hangs (an MLX call that never
returns) once a request asks for it with "HANG" in its last message, or
hangs admitting a request that says "HANG_ADMIT": for the watchdog tests,
which need a real process to exit."""

import sys
import time

from mlx_lm_plus import engine
from mlx_lm_plus.server import main

_insert, _step = engine._Batch.insert, engine._Batch.step
hang = []


def insert(self, channel, request, args):
    text = str(request.messages[-1].get("content")) if request.messages else ""
    if "HANG_ADMIT" in text:  # stuck while the request is being admitted
        time.sleep(3600)
    if "HANG" in text:
        hang.append(True)
    return _insert(self, channel, request, args)


def step(self):
    if hang:
        time.sleep(3600)
    return _step(self)


engine._Batch.insert, engine._Batch.step = insert, step

if __name__ == "__main__":
    main(sys.argv[1:])
