"""mlx_lm_plus.server whose batch step hangs (an MLX call that never
returns) once a request asks for it with "HANG" in its last message: for the
watchdog test, which needs a real process to exit."""

import sys
import time

from mlx_lm_plus import engine
from mlx_lm_plus.server import main

_insert, _step = engine._Batch.insert, engine._Batch.step
hang = []


def insert(self, channel, request, args):
    if request.messages and "HANG" in str(request.messages[-1].get("content")):
        hang.append(True)
    return _insert(self, channel, request, args)


def step(self):
    if hang:
        time.sleep(3600)
    return _step(self)


engine._Batch.insert, engine._Batch.step = insert, step

if __name__ == "__main__":
    main(sys.argv[1:])
