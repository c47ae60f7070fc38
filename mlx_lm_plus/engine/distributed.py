"""mx.distributed from the generation thread's side: rank 0 reads the HTTP
requests and hands each to the other ranks (`Group.share`), every rank
computes, and they must take the same steps in the same order. What ends
the group, and the one allowlist of classes a handed-off request is
unpickled from."""

import io
import logging
import pickle
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional

import mlx.core as mx

from mlx_lm_plus.engine.handoffs import Queued
from mlx_lm_plus.engine.channel import Channel
from mlx_lm_plus.errors import EngineUnavailable, InternalError, ModelLoadError, is_out_of_memory
from mlx_lm_plus.models.provider import group_max
from mlx_lm_plus.models.folders import loadable_fingerprint

# The places of the loop where rank 0 hands something to the other ranks
# (checked alike on every rank, as the count of hand-offs is).
HANDOFF_REQUEST, HANDOFF_STOPPED = 1, 2


def is_group_lost(error: BaseException) -> bool:
    """A collective of mx.distributed failed: a rank died or its link went
    ("[ring] connection to a peer was lost", and the other backends' own)."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        tag in text for tag in ("[ring]", "[mpi]", "[jaccl]", "[nccl]"))



class GroupDiverged(RuntimeError):
    """The ranks of mx.distributed are no longer at the same turn of the loop."""



def ends_the_group(error: BaseException) -> bool:
    """Under mx.distributed: an error after which the ranks may be out of
    step, so the group must end. A lost rank, or any error of MLX's (a
    RuntimeError: an allocation failure, Metal's limit on one buffer, which
    differs between Macs): a host's own, while the other ranks went on with
    the step this one gave up. (A rank out of step does not reliably hang:
    collectives of different sizes pair up and return garbage.) Errors of a
    request (ValueError: PromptError, a constraint's) are the same on every
    rank and fail that request only."""
    if isinstance(error, (EngineUnavailable, ModelLoadError, InternalError)):
        return False
    return is_out_of_memory(error) or isinstance(error, RuntimeError)



def group_end_reason(error: BaseException) -> str:
    if is_group_lost(error):
        return "a rank of the distributed group was lost"
    if isinstance(error, GroupDiverged):
        return "the ranks of the distributed group went out of step"
    if is_out_of_memory(error):
        return "out of memory on a rank of the distributed group"
    return "an error on a rank of the distributed group"



def group_lost_error(error: BaseException) -> "EngineUnavailable":
    """What a request held when the group ended gets (a 503)."""
    return EngineUnavailable(
        f"Generation engine unavailable: {group_end_reason(error)}: {error}")



# The classes a request handed to the other ranks is made of (besides the
# parsed JSON's builtins). The ring's TCP is not authenticated: no other
# class, and no function, is unpickled from it (rank 0 checks its own first).
_HANDED_OFF_CLASSES = {
    ("mlx_lm.server", "GenerationArguments"), ("mlx_lm.server", "SamplingArguments"),
    ("mlx_lm.server", "LogitsProcessorArguments"), ("mlx_lm.server", "ModelDescription"),
    ("mlx_lm_plus.protocols.validation", "Request"), ("mlx_lm_plus.models.images", "DecodedImage"),
    ("mlx_lm_plus.planning.grammars", "Grammar"), ("mlx_lm_plus.planning.grammars", "ForcedToolCall"),
    ("mlx_lm_plus.planning.grammars", "StrictToolCalls"), ("PIL.Image", "Image"),
    ("builtins", "set"), ("builtins", "frozenset"),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _HANDED_OFF_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a request")


def _unpickle(data: bytes):
    return _Unpickler(io.BytesIO(data)).load()



class Group:
    """The ranks of mx.distributed, as the generation thread sees them (a
    group of one: nothing is shared, every fact is this rank's own).

    `on_clear` runs when the ranks clear their prompt caches together (at a
    hand-off, for DELETE /v1/cache on rank 0); `on_stop` when rank 0 says
    it stops (at any hand-off: the ranks stop together)."""

    def __init__(self, store, on_clear: Callable[[], None], on_stop: Callable[[], None]):
        group = mx.distributed.init()
        self.is_distributed = group.size() > 1
        self.rank = group.rank()
        self.size = group.size()
        self.store = store
        self.on_clear = on_clear
        self.on_stop = on_stop
        self.handoffs = 0  # hand-offs so far (the same on every rank, checked)
        # Rank 0's time.monotonic() at the last hand-off: every rank's store
        # reads it (one clock for expiry and recency, whatever the hosts' own).
        self.clock = time.monotonic()
        self.stopped = False  # rank 0 said it stops (ranks other than 0)
        self._clear_wanted: Optional[Future] = None  # DELETE /v1/cache, for the ranks
        self._clear_lock = threading.Lock()

    def share_object(self, obj, site: int, stopping: bool):
        """Rank 0's `obj` on every rank (None: nothing to share), at hand-off
        `site` (a number of its own for each place of the loop); `stopping`:
        whether rank 0 stops."""
        if not self.is_distributed:
            return obj
        data = self.share(pickle.dumps(obj) if self.rank == 0 and obj is not None else b"",
                          site, stopping)
        return obj if self.rank == 0 or data is None else _unpickle(data)

    def share(self, data: bytes, site: int, stopping: bool) -> Optional[bytes]:
        """Rank 0's pickled `data` on every rank (None: none), after a header:
        each rank's count of hand-offs and `site`, checked alike on every
        rank (else the ranks went out of step: GroupDiverged ends the
        group); rank 0's clock (the one every rank's store reads); whether
        rank 0 stops (`stopped` then); whether it was asked to clear the
        prompt cache."""
        self.handoffs += 1
        first = self.rank == 0
        clear = self._clear_wanted if first else None
        # (One all_sum carries it all: a count, or a site, is alike on every
        # rank when n * sum(x^2) == sum(x)^2; the count kept small, so no
        # sum overflows.)
        turn = self.handoffs % (1 << 20)
        size, turns, squares, sites, site_squares, clock, stop, clearing = \
            mx.distributed.all_sum(mx.array([
                len(data) if first else 0, turn, turn * turn, site, site * site,
                int(time.monotonic() * 1e6) if first else 0, int(stopping) if first else 0,
                int(clear is not None)], dtype=mx.int64)).tolist()
        n = self.size
        if n * squares != turns * turns or n * site_squares != sites * sites:
            raise GroupDiverged(f"hand-off {self.handoffs} (at {site}) on rank "
                                f"{self.rank}: the ranks are at different ones")
        self.clock = clock / 1e6
        if stop:
            self.stopped = True
            self.on_stop()
        if clearing:  # (DELETE /v1/cache on rank 0)
            self.store.clear()
            self.on_clear()
            if clear is not None:
                with self._clear_lock:
                    self._clear_wanted = None
                clear.set_result(True)
        if size == 0:
            return None
        payload = mx.array(memoryview(data)) if first else mx.zeros(size, dtype=mx.uint8)
        return bytes(memoryview(mx.distributed.all_sum(payload)))

    def clear_everywhere(self, timeout: float = 60):
        """DELETE /v1/cache on rank 0 (an HTTP thread): every rank clears its
        store at the next hand-off (one store alone cleared would leave the
        others resuming prompts it recomputes)."""
        with self._clear_lock:
            if self._clear_wanted is None:
                self._clear_wanted = Future()
            cleared = self._clear_wanted
        try:
            cleared.result(timeout=timeout)  # (a hand-off comes every loop turn)
        except FutureTimeout:
            raise EngineUnavailable("Generation engine unavailable: the distributed group "
                                    f"did not clear the prompt cache within {timeout:g} s")

    def fail_clear(self, error: Exception):
        """A DELETE /v1/cache waiting for a hand-off that will not come."""
        with self._clear_lock:
            cleared, self._clear_wanted = self._clear_wanted, None
        if cleared is not None and not cleared.done():
            cleared.set_exception(error)

    def gone(self, channel) -> bool:
        """Whether the request's client went away. Only rank 0 sees it: under
        mx.distributed every rank asks at the same point (a collective) and
        gets rank 0's answer, so that all let the request go together."""
        if not self.is_distributed:
            return channel.cancelled
        return bool(group_max([channel.cancelled])[0])

    def on_every_rank(self, fact: bool) -> bool:
        """Whether `fact`, true on this rank, is on every rank of the group
        (a pipeline rank judges its own layers; a collective)."""
        return fact if not self.is_distributed else not group_max([not fact])[0]

    def agree_on_the_store(self):
        """Under mx.distributed every rank's store must make the same
        decisions: the group keeps the smallest rank's budget (the default
        is a share of each host's memory), evicts as the rank with the most
        to give back (a pipeline rank holds its own layers' share of every
        entry), and reads rank 0's clock (for --prompt-cache-ttl and least
        recently used, as of the latest hand-off)."""
        store = self.store
        store.group_max = group_max
        store.set_clock(lambda: self.clock)
        store.max_bytes = -group_max([-store.max_bytes])[0]
        logging.info(f"Prompt cache budget {store.max_bytes / 1e6:.2f} MB, the smallest "
                     f"of the {self.size} ranks'")

    def agree_on_random_state(self):
        """Every rank draws alike from now on (rank 0's and the others' seeds
        summed)."""
        seed = mx.distributed.all_sum(mx.random.state[0]).view(mx.uint64).item()
        mx.random.seed(seed)

    def loadable(self, channel, key, pipeline: bool) -> Optional[ModelLoadError]:
        """Under mx.distributed every rank must be able to load a model
        before any starts to (a load that fails on one rank leaves the others
        in its collectives): no adapter or draft model (not in distributed
        mode, as upstream), and on every rank a config.json (the same one),
        of a family mlx-lm has, and weights. Else a 404 on every rank, before
        the model loaded makes room. Looked at once per request (set aside,
        it is looked at again every loop turn, alike on every rank)."""
        if getattr(channel, "loadable", None) == key:
            return None
        problem, fingerprint = None, 0
        try:
            if key[1] is not None or key[2] is not None:
                raise ValueError("Loading with adapters or draft models not supported in "
                                 "distributed mode")
            fingerprint = loadable_fingerprint(key[0], pipeline=pipeline)
        except Exception as e:
            problem = e
        failed, most, minus_least = group_max([problem is not None, fingerprint, -fingerprint])
        if not failed and most == -minus_least:
            channel.loadable = key
            return None
        why = problem or ("another rank can't load it" if failed
                          else "its config.json differs between the ranks")
        logging.error(f"Can't load {key[0]}: {why}")
        return ModelLoadError(f"Can't load {key[0]}: {why}")

    def hand_off(self, request, data: bytes, stopping: bool):
        """The request rank 0 took off its queue (`request`, pickled as
        `data` by `pickled`; None and b"" when it has none), on every rank,
        as (channel, request, args): the other ranks get a sink for the
        channel. A collective: it waits for every rank (a dead one hangs
        it)."""
        data = self.share(data, HANDOFF_REQUEST, stopping)
        # (Rank 0 keeps its own; the others get a sink for the channel.)
        shared = request[1:3] if request is not None else (
            None if data is None else _unpickle(data))
        if shared is None:
            return None
        channel = request[0] if request is not None else Channel()
        return Queued(channel, *shared)  # (plans are made on every rank: none ahead)


def pickled(request) -> bytes:
    """A queued request's (request, args), as the other ranks will unpickle
    them (raises where they can't be)."""
    data = pickle.dumps(tuple(request[1:3]))
    _unpickle(data)
    return data
