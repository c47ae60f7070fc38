"""mlx_lm_plus.server with a bug planted where a stream has started: the
assembler's finish raises for a request of exactly 7 tokens, and a
Responses stream's first frames raise when its instructions say
"explode at start". For the tests of what an open stream does with an
error it did not expect."""

import sys

from mlx_lm_plus.protocols import assembler as responses; from mlx_lm_plus.protocols import responses as responses_api
from mlx_lm_plus.server import main

_finish = responses.CompletionAssembler.finish
_start = responses_api.ResponsesExchange.start


def finish(self):
    if len(self.tokens) == 7:
        raise RuntimeError("planted failure at the end")
    return _finish(self)


def start(self, *args, **kw):
    if self.request.echo.get("instructions") == "explode at start":
        raise RuntimeError("planted failure at the start")
    return _start(self, *args, **kw)


responses.CompletionAssembler.finish = finish
responses_api.ResponsesExchange.start = start

if __name__ == "__main__":
    main(sys.argv[1:])
