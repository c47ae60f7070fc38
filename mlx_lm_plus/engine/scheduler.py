"""Which request the generation thread admits next: the queue the HTTP side
submits to (requests that arrived together sorted shortest work first), the
requests set aside while their model loads or makes room, and under
mx.distributed the hand-off of each request to the other ranks."""

import logging
import time
from queue import Empty, Queue
from typing import Callable, Optional, Tuple

from mlx_lm_plus.engine.handoffs import BLOCKED, LOADING, READY, ROOM
from mlx_lm_plus.engine.distributed import ends_the_group, pickled
from mlx_lm_plus.errors import InternalError, request_error
from mlx_lm_plus.planning.embedding import EMBEDDING_REQUESTS, EmbeddingPlan

# A prefill wave (the first step of requests admitted while nothing decodes)
# waits for requests the HTTP side is still planning (Engine.arrivals): at
# most ARRIVAL_GAP seconds for the next to come, WAVE_WAIT in all, so that
# requests sent together share one wave rather than the first going alone
# and the rest waiting for it. A lone request has none to wait for.
ARRIVAL_GAP = 0.005
WAVE_WAIT = 0.025


class Scheduler:
    """`is_batchable(lm, request, args)`: whether a request joins its model's
    batch; `any_active()`: whether a batch has requests; `decoding()`:
    whether a request of any batch is past its prompt; `stopping()`:
    whether rank 0 stops (told to the other ranks at the hand-off);
    `group_lost(error)`: the error a request held when the group ended
    gets."""

    def __init__(self, provider, store, group, watchdog, residency,
                 is_batchable: Callable, any_active: Callable[[], bool],
                 decoding: Callable[[], bool], stopping: Callable[[], bool],
                 group_lost: Callable):
        self.provider = provider
        self.store = store
        self.group = group
        self.watchdog = watchdog
        self.residency = residency
        self.is_batchable = is_batchable
        self.any_active = any_active
        self.decoding = decoding
        self.stopping = stopping
        self.group_lost = group_lost
        self.queue = Queue()  # handoffs.Queued, as submitted
        self.pending = []  # requests set aside: waiting for a model to load or for room
        self._placed = set()  # ids of the waiting requests that ordering placed
        self.admitting = None  # the channel of the request being placed
        self.handing_off = None  # the channel of the request shared with the ranks
        # How many requests the HTTP side has taken in and not submitted yet
        # (parsing, planning): set by the app; see await_arrivals.
        self.arrivals: Callable[[], int] = lambda: 0
        self.wave_since: Optional[float] = None  # first admission of a wave not stepped yet

    def next(self):
        """The next request to admit: the first one set aside that can go now,
        else a new one off the queue (set aside if it can't go yet). None
        when there is nothing to admit. A request set aside that is BLOCKED
        holds back every request after it (the running ones drain); one
        waiting for ROOM holds back all but those for pinned models (which
        are never the ones unloaded to make room)."""
        room_wait = False
        for request in list(self.pending):
            if room_wait and not self.for_pinned(request):
                continue
            state = self.readiness(request)
            if state is READY or isinstance(state, Exception):
                self.pending.remove(request)
                if state is READY:
                    return request
                request[0].put(state)
            elif state is BLOCKED:
                return None
            elif state is ROOM:
                room_wait = True
        busy = self.any_active()
        if not busy:
            self.watchdog.idle()
        request = self._next_request(
            timeout=None if busy else 0.02 if self.residency.loading is not None else 0.1)
        if request is None:
            return None
        # Held while it is placed (under mx.distributed its model may load
        # here), so that a crash or the watchdog answers it.
        self.admitting = request[0]
        try:
            state = LOADING if room_wait and not self.for_pinned(request) else \
                self.readiness(request)
        finally:
            self.admitting = None
        if state is READY:
            return request
        if isinstance(state, Exception):
            request[0].put(state)
        else:
            request[0].set_aside_at = time.monotonic()
            self.pending.append(request)
        return None

    def await_arrivals(self) -> bool:
        """Before a prefill wave starts (requests admitted while no row
        decodes, so no stream waits for a token): if the HTTP side is still
        planning requests, wait a little for them (ARRIVAL_GAP for the next,
        WAVE_WAIT in all) so they join this wave instead of waiting for all
        of it. Returns whether one came (to be admitted first)."""
        since = self.wave_since
        if since is None or self.group.is_distributed or self.arrivals() <= 0 or self.decoding():
            self.wave_since = None
            return False
        wait = min(ARRIVAL_GAP, since + WAVE_WAIT - time.monotonic())
        queue = self.queue
        with queue.not_empty:
            came = wait > 0 and queue.not_empty.wait_for(lambda: bool(queue.queue), wait)
        if not came:
            self.wave_since = None
        return bool(came)

    def _order_arrivals(self):
        """Requests that arrived together go shortest work first: a burst's
        short prompts then fill the first prefill wave, not padded to a long
        one's length. Only those that arrived since the engine last looked at
        its queue are sorted, behind the ones still waiting from before, so a
        long prompt waits only for those that came with it, never for later
        ones (on the sequential path, where the queue isn't emptied every
        step, too). Work: the prompt's tokens past what the store would
        serve. Requests not planned ahead (planned at admission; all of them
        under mx.distributed) keep their order, after the others that came
        with them."""
        with self.queue.mutex:
            waiting = list(self.queue.queue)
        new = [r for r in waiting if id(r) not in self._placed]
        work = {}
        if len(new) > 1:
            try:
                work = {id(r): self._work(r) for r in new}  # (`waiting` keeps the ids)
            except Exception:  # (an optimisation: arrival order serves)
                logging.exception("Could not order the waiting requests")
        if not work:  # (nothing to sort: all of them keep their places)
            self._placed = {id(r) for r in waiting}
            return
        with self.queue.mutex:
            queue = self.queue.queue
            items = list(queue)
            before = [r for r in items if id(r) in self._placed]
            together = sorted((r for r in items if id(r) in work), key=lambda r: work[id(r)])
            later = [r for r in items if id(r) not in self._placed and id(r) not in work]
            queue.clear()
            queue.extend(before + together + later)
            present = {id(r) for r in items}
            self._placed = {id(r) for r in waiting if id(r) in present}

    def _work(self, request) -> Tuple[int, int]:
        planned = request[3]
        if planned is None:
            return 1, 0
        if isinstance(planned, EmbeddingPlan):
            return 0, planned.prompt_tokens
        key = planned.plan.cache_key
        return 0, len(key) - self.store.covers(planned.model_key, key)

    def _next_request(self, timeout=None):
        request = None
        if not self.group.is_distributed or self.group.rank == 0:
            if len(self.queue.queue) > 1:  # (each request is sorted, and walked, once)
                self._order_arrivals()
            try:
                if timeout is not None:
                    request = self.queue.get(timeout=timeout)
                elif self.queue.queue:  # (a look without the lock, every step)
                    request = self.queue.get_nowait()
            except Empty:
                pass
            if request is not None:
                self._placed.discard(id(request))  # (its id may pass on to a new one)
        if not self.group.is_distributed:
            return request
        data = b""
        if request is not None:
            try:  # (before any collective: a request that can't be sent is its own error)
                data = pickled(request)
            except Exception as e:
                request[0].put(InternalError(f"Could not hand the request to the other "
                                             f"ranks: {e!r}"))
                request, data = None, b""
        # A collective: it waits for every rank (a dead one hangs it).
        self.watchdog.beat("sharing requests with the other ranks")
        # Held here while it is handed off, so a lost group answers it.
        self.handing_off = request[0] if request is not None else None
        try:
            return self.group.hand_off(request, data, self.stopping())
        except Exception as e:
            if request is not None:
                request[0].put(self.group_lost(e))
            raise
        finally:
            self.handing_off = None

    def readiness(self, request):
        """READY, LOADING, ROOM or BLOCKED (see their definition), or the
        error the request gets. Starts the request's model loading when it isn't
        loaded and there is room."""
        try:
            return self._find_readiness(request)
        except Exception as e:  # (what slipped past validation: this request's)
            if self.group.is_distributed and ends_the_group(e):
                request[0].put(self.group_lost(e))
                raise  # (the whole group is down: _run ends it)
            logging.exception("Could not place a request")
            return request_error(e, "admitting the request")

    def _find_readiness(self, request):
        channel, req, args, _ = request
        if self.group.gone(channel):
            return READY  # (_admit lets it go)
        provider = self.provider
        key = provider.key_for(args.model)
        lm = provider.get(key)
        if lm is None:
            return self.residency.readiness(channel, key)
        # (Embedding work runs beside the batches; a request of the wrong kind
        # for its model is answered at admission.)
        if (isinstance(req, EMBEDDING_REQUESTS) or lm.embedder is not None
                or getattr(req, "count_only", False) or self.is_batchable(lm, req, args)):
            return READY
        # Served sequentially: it has the thread to itself.
        return BLOCKED if self.any_active() else READY

    def key_of(self, request):
        """The model key a request names, or None where naming it raises
        (what slipped past validation: _readiness answers it)."""
        try:
            return self.provider.key_for(request[2].model)
        except Exception:
            return None

    def for_pinned(self, request) -> bool:
        key = self.key_of(request)
        if key is None:
            return True  # (let _readiness answer it)
        lm = self.provider.get(key)
        return lm is not None and lm.pinned

    def waiting_for(self):
        """The models that requests set aside are for."""
        return {self.key_of(request) for request in self.pending}

    def fail_waiting(self, key, error):
        """Answer the requests set aside for model `key` with `error`."""
        kept, failed = [], []
        for r in self.pending:
            (failed if self.key_of(r) == key else kept).append(r)
        self.pending = kept
        for request in failed:
            request[0].put(error)

    def fail_queue(self, error: Exception):
        while True:
            try:
                channel = self.queue.get_nowait()[0]
            except Empty:
                return
            channel.put(error)
