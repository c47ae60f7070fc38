"""The engine: one generation thread that owns the model and a BatchGenerator.

Requests arrive through `Engine.submit` with a `channel` (anything with a
thread-safe `put`). The generation thread answers on that channel, in order:

    GenerationContext            the request was accepted (prompt size, cache hit)
    (processed, total) tuples    prefill progress
    Response ...                 one per generated token
    None                         done

or an Exception instead of any of these. This is the protocol of
mlx_lm.server 0.32.2's ResponseGenerator, so the pieces it hands around
(GenerationContext, Response, GenerationArguments) are reused as they are.

Batchable requests (no seed, no draft model, no images) join the running
BatchGenerator; the others are served one at a time by `_serve_single` with
`stream_generate`, as upstream does. Differences from upstream, each on purpose:
  * with --kv-bits, requests are batched too (quantized_batch.py), where
    upstream serves them one at a time;
  * new requests are picked up between every generation step (upstream runs
    0.5 s of steps between looks), except under mx.distributed where every look
    costs a collective;
  * a request whose client went away (`ctx.stop()`) leaves the batch at the
    next step wherever it is, queued, in prefill or in decode;
  * an exception inside a batch step fails the requests of that batch, not the
    thread: the batch is rebuilt and later requests are served;
  * prompts arrive planned (`Engine.plan`, on the HTTP layer's planning
    thread): this thread only looks them up in the store and runs the model;
  * a request that shares a prefix not cached yet with a request in the
    batch about to store a checkpoint there waits for it (`_Batch.park`);
  * a step's events go to their channels in one hand-off (`deliver`);
  * several models are served at once: each loaded model has its own
    BatchGenerator, and this thread steps the active ones in turn. A model is
    loaded on the loader thread while the others keep generating, and
    unloaded (least recently used first) only when nothing runs on it
    (`_readiness`, `_make_room`, `_housekeeping`).
"""

import copy
import gc
import io
import itertools
import logging
import math
import os
import pickle
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from queue import Empty, Queue
import threading
from threading import Thread
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import (
    BatchGenerator,
    make_stop_sequences,
    make_text_state_machine,
    maybe_quantize_kv_cache,
    stream_generate,
)
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.server import (
    GenerationContext,
    Response,
    TimeBudget,
    _image_parts,
    _make_logits_processors,
    _make_sampler,
)
from mlx_lm.server import _format_top_logprobs as _upstream_top_logprobs

from mlx_lm_plus.patches import apply_all as _apply_patches

from mlx_lm_plus.cache.store import PromptStore, cache_nbytes, is_plain_kv, trims_to_any_prefix
from mlx_lm_plus.models.provider import group_max, loadable_fingerprint
from mlx_lm_plus.planning.constraints import ConstraintError, processor_for
from mlx_lm_plus.models.cpu import weights_identity
from mlx_lm_plus.logs import warn_once
from mlx_lm_plus.planning.reasoning import ThinkingBudget, thinking_budget
from mlx_lm_plus.planning.prompt import (
    PromptPlan, build_prompt, check_prompt_size, prompt_chars, split_at, template_kwargs,
)
from mlx_lm_plus.engine.quantized_batch import QuantizedBatchGenerator, supports_quantized_batching
from mlx_lm_plus.engine import taps
from mlx_lm_plus.protocols.validation import RequestError, check_vocab
from mlx_lm_plus.models.vision import VisionPrompt, VisionSupport, set_rope_delta
from mlx_lm_plus.models.vlm_generation import MlxVlmGeneration, responses


# A checkpoint is stored only this many tokens or more after the previous one
# (or the cached prefix): fewer are cheaper to recompute than a model call of
# their own. (16 cost the branch workload 11% more recomputation.)
MIN_SEGMENT_TOKENS = 4
# What Engine._prepare returns for a request _Batch.park held back.
PARKED = object()
# A request waits for another one in the batch to store a checkpoint it shares
# (its system prompt, say) when that saves it at least this many tokens.
PARK_MIN_TOKENS = 32
# While requests decode, a prompt goes in chunks of --prefill-step-size over
# this (at least DECODING_CHUNK_MIN tokens). BatchGenerator runs one prompt
# chunk after each decode step, so a running stream waits a whole chunk
# between two tokens: a smaller chunk keeps it flowing while a long prompt is
# admitted, for a few more (and a little less efficient) model calls of that
# prompt. Alone, a prompt takes whole chunks.
DECODING_CHUNK_DIVISOR = 4
DECODING_CHUNK_MIN = 32
# The batch steps from a prompt being in (but its last token) to its first
# token handed out: they run without a prompt chunk (_Batch._step), and no
# more than this many do in a row.
FIRST_TOKEN_STEPS = 2
# A prefill wave (the first step of requests admitted while nothing decodes)
# waits for requests the HTTP side is still planning (Engine.arrivals): at
# most ARRIVAL_GAP seconds for the next to come, WAVE_WAIT in all, so that
# requests sent together share one wave rather than the first going alone
# and the rest waiting for it. A lone request has none to wait for.
ARRIVAL_GAP = 0.005
WAVE_WAIT = 0.025
# Decode steps between two checks of the byte budget against the growing caches
# of a batch (a KV buffer grows by 256 tokens at a time).
BUDGET_EVERY = 16
# The places of the loop where rank 0 hands something to the other ranks
# (checked alike on every rank, as the count of hand-offs is).
HANDOFF_REQUEST, HANDOFF_STOPPED = 1, 2
# What a request taken off the queue waits for (Engine._readiness): nothing
# (READY); a model load on the loader thread (LOADING: later requests may go
# first); a model that must go idle to make room for its own (ROOM: later
# requests wait behind it, but for those of pinned models, so the running
# ones drain); or, served sequentially, the thread to itself (BLOCKED: every
# later request waits behind it).
READY, LOADING, ROOM, BLOCKED = "ready", "loading", "room", "blocked"
# Seconds between two looks at idle models (TTL, keep_alive).
HOUSEKEEPING_EVERY = 0.25
# Seconds between two keepalives to the requests set aside (waiting for a
# model to load or for room): a stream's client and proxies see it is alive.
KEEPALIVE_EVERY = 5.0
# Exit status of a process whose generation thread hung (EX_SOFTWARE): a
# supervisor restarts it (README: systemd and launchd examples).
HANG_EXIT_STATUS = 70


class Channel:
    """Where the generation thread sends a request's events.

    This base class drops them (the sink of ranks other than 0 under
    mx.distributed); the HTTP side subclasses it with an asyncio hand-off.
    `cancelled` is set by the consumer when its client went away.
    """

    cancelled = False
    cancelled_at: Optional[float] = None  # time.monotonic() of the cancel
    removed_at: Optional[float] = None  # when the engine let the request go
    set_aside_at: Optional[float] = None  # waiting for a model: its last keepalive

    def put(self, item):
        pass

    @staticmethod
    def put_all(events):
        """Put each (channel, event) pair (of this class), in order."""
        for channel, event in events:
            channel.put(event)

    def cancel(self):
        if not self.cancelled:
            self.cancelled_at = time.monotonic()
        self.cancelled = True

    def removed(self):
        """The engine dropped this cancelled request (disconnect latency)."""
        if self.removed_at is None:
            self.removed_at = time.monotonic()


def deliver(events):
    """Put (channel, event) pairs, in order, with one `put_all` per channel
    class (the HTTP side's makes it one hand-off to the event loop)."""
    groups = {}
    for channel, event in events:
        groups.setdefault(type(channel).put_all, []).append((channel, event))
    for put_all, group in groups.items():
        put_all(group)


class _Cancelled(Exception):
    """The client of the request being prefilled went away."""


class EngineUnavailable(RuntimeError):
    """The generation thread is not running."""


class PromptError(ValueError):
    """The request could not be turned into a prompt (bad content, template)."""


class ModelLoadError(RuntimeError):
    """The requested model, adapter or draft model could not be loaded."""


class OutOfMemory(EngineUnavailable):
    """MLX could not allocate memory for this request (503, try again later)."""


class InternalError(RuntimeError):
    """Something failed that is not the client's fault (500)."""


@dataclass(eq=False)  # (identity: Engine._image_plans is a WeakSet of them)
class Planned:
    """A request planned off the generation thread (`Engine.plan`, run by the
    HTTP layer's planning thread): its prompt plan and its constraint's
    logits processor, for the model it was planned with. The generation
    thread uses it as it is when that model is the one it runs."""

    model_key: Any
    plan: PromptPlan
    constraint: Any = None  # a constraints.ConstraintProcessor, or None
    budget: Any = None  # a reasoning.ThinkingBudget, or None
    # The model has a disk tier: Engine.read_ahead may read its entry first.
    on_disk: bool = False


@dataclass
class Admission:
    """A request ready to join a batch: everything `_Batch.insert` needs."""

    channel: Any
    args: Any
    plan: PromptPlan
    ctx: Any  # GenerationContext
    stop_sequences: Any
    cache: Optional[List[Any]]  # from the store (None: a fresh cache)
    cached: int  # prompt tokens the cache covers
    segments: List[List[int]]  # the rest of the prompt, split at checkpoints
    segment_types: List[str]
    constraint: Any
    budget: Any = None  # a reasoning.ThinkingBudget, or None


def is_out_of_memory(error: BaseException) -> bool:
    """An MLX allocation failure ("[metal::malloc] Unable to allocate ...",
    "[malloc] ...", "[cuda::malloc] ...")."""
    if isinstance(error, MemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("malloc]" in text or "Unable to allocate" in text)


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
    ("mlx_lm_plus.protocols.validation", "Request"), ("mlx_lm_plus.models.vision", "DecodedImage"),
    ("mlx_lm_plus.planning.constraints", "Grammar"), ("mlx_lm_plus.planning.constraints", "ForcedToolCall"),
    ("mlx_lm_plus.planning.constraints", "StrictToolCalls"), ("PIL.Image", "Image"),
    ("builtins", "set"), ("builtins", "frozenset"),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _HANDED_OFF_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a request")


def _unpickle(data: bytes):
    return _Unpickler(io.BytesIO(data)).load()


def request_error(error: Exception, what: str) -> Exception:
    """The error a request's client gets for `error`, raised while doing `what`:
    errors of ours as they are, an allocation failure as OutOfMemory, anything
    else as an InternalError (a 500, never a hang)."""
    if isinstance(error, (PromptError, ModelLoadError, EngineUnavailable, InternalError)):
        return error
    if "maximum allowed buffer size" in str(error):
        # Metal's limit on one buffer: this request can never fit, retrying
        # won't help (400, and no reason to give up the prompt cache).
        return PromptError(f"The request needs a larger buffer than this machine "
                           f"allows while {what}: {error}")
    if is_out_of_memory(error):
        return OutOfMemory(f"Out of memory while {what}: {error}")
    return InternalError(f"Internal error while {what}: {error!r}")


class Engine:
    def __init__(self, model_provider, store: PromptStore):
        self.model_provider = model_provider
        self.store = store
        self.requests = Queue()
        self._state_machines = {}
        self._model_facts = {}  # (model key, what) -> see _per_model
        group = mx.distributed.init()
        self._is_distributed = group.size() > 1
        self._rank = group.rank()
        self._group_size = group.size()
        self._time_budget = TimeBudget()
        self._stop = False
        # Why the engine is down (None while it serves), for /health.
        self.unhealthy_reason: Optional[str] = None
        self.restarts = 0
        self.restart_delay = 1.0
        self.max_restarts = 5  # within restart_window seconds, then stay down
        self.restart_window = 60.0
        self._crash_times = []
        # What the generation thread holds, so a crash can answer every
        # request it had taken (the batches, one per loaded model; requests
        # set aside; the one being served sequentially).
        self._batches: Dict[Any, _Batch] = {}
        self._pending = []
        # Models load here, one at a time, while the generation thread goes
        # on with the others: (key, Future) of the load running, or None.
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="mlx_lm_plus-loader")
        self._loading: Optional[tuple] = None
        self._housekept = 0.0  # when idle models were last looked at
        self._started = False  # the default model is loaded at the first start only
        self._current = None
        self._current_key = None  # the model of the request served sequentially
        self._clear_buffers = False
        self._unloaded = False  # a model was unloaded: clear MLX's buffer cache when idle
        self.steps = 0  # generation steps run, for disconnect measurements
        self._placed = set()  # ids of the waiting requests that ordering placed
        # Where the generation thread's time goes, in seconds (/v1/stats, the
        # benchmarks): "model" in model steps (BatchGenerator.next, which
        # samples too), "admission" admitting requests (a plan made here
        # when it could not be made before, the store lookup, images through
        # the vision tower), "outside_model" the rest of each step (tokens to
        # their requests, stores at checkpoints and at a request's end).
        self.thread_seconds = {"model": 0.0, "admission": 0.0, "outside_model": 0.0}
        self.admitted = 0  # requests admitted
        self.planned_at_admission = 0  # of them, planned on this thread (not before)
        self.tokens_out = 0  # tokens generated
        self.metrics = None  # a metrics.Metrics, set by the app
        # How many requests the HTTP side has taken in and not submitted yet
        # (parsing, planning): set by the app; see _await_arrivals.
        self.arrivals: Callable[[], int] = lambda: 0
        self._wave_since: Optional[float] = None  # first admission of a wave not stepped yet
        self._thread = Thread(target=self._run, name="mlx_lm_plus-generation")
        self._thread.daemon = True
        # The watchdog (--step-timeout): what the generation thread is busy
        # with and since when, or None while it waits for work or loads a
        # model. A stuck MLX call can't be interrupted, so a hang ends the
        # process (exit_process, replaced in tests) for a supervisor to
        # restart.
        self._busy: Optional[tuple] = None
        self._admitting = None  # the channel of the request being admitted
        self._handing_off = None  # the channel of the request shared with the ranks
        self._handoffs = 0  # hand-offs so far (the same on every rank, checked)
        # Rank 0's time.monotonic() at the last hand-off: every rank's store
        # reads it (one clock for expiry and recency, whatever the hosts' own).
        self.group_clock = time.monotonic()
        self._group_stopped = False  # rank 0 said it stops (ranks other than 0)
        self._clear_wanted: Optional[Future] = None  # DELETE /v1/cache, for the ranks
        self._clear_lock = threading.Lock()
        self._shutting_down = threading.Lock()
        # Image requests planned ahead and not admitted yet (their plans hold
        # the processor's pixel arrays, larger than the decoded images):
        # at most --prompt-concurrency; the rest are planned at admission.
        self._image_plans = weakref.WeakSet()
        self._image_planning = 0  # image plans being made (in the planning lanes)
        self._image_lock = threading.Lock()
        self.hung = False
        self.exit_process = os._exit

    @property
    def cli_args(self):
        return self.model_provider.cli_args

    def start(self):
        # The upstream fixes in patches/, applied here rather than on import
        # (idempotent; each checks it matches the installed mlx-lm).
        _apply_patches()
        self._thread.start()
        if self._watch_limit() < math.inf:
            Thread(target=self._watchdog, name="mlx_lm_plus-watchdog", daemon=True).start()

    # -- watchdog --

    def _beat(self, what: str, limit: Optional[tuple] = None):
        """The generation thread starts a unit of work (a step, a chunk);
        `limit`: its own (seconds, the flag that sets them), else
        _watch_limit()."""
        self._busy = (what, time.monotonic(), limit)

    def _idle(self):
        self._busy = None

    def _watch_limit(self) -> float:
        """Seconds a unit of work may take: --step-timeout, and under
        mx.distributed at most --distributed-timeout, since a rank that is
        gone (its host down, its link cut) shows as a collective that never
        returns, between requests too (the hand-off every loop turn)."""
        limits = [getattr(self.cli_args, "step_timeout", 0) or math.inf]
        if self._is_distributed:
            limits.append(getattr(self.cli_args, "distributed_timeout", 0) or math.inf)
        return min(limits)

    def _watchdog(self):
        limit = self._watch_limit()
        while not self._stop:
            time.sleep(min(1.0, limit / 4))
            busy = self._busy
            if busy is not None:
                what, since, own = busy
                seconds, flag = own or (limit, None)
                if time.monotonic() - since > seconds:
                    self._on_hang(what, time.monotonic() - since, seconds, flag)
                    return
            # (Plans made ahead are not watched: a slow one fails its own
            # request, past --planning-timeout; see lanes.py.)

    def _on_hang(self, what: str, seconds: float, limit: float, flag: Optional[str] = None):
        """The generation thread is stuck: say so, answer everyone, exit.
        `flag`: what set `limit` (None: the watchdog's own)."""
        if flag is None:
            flag = ("--distributed-timeout" if limit != self.cli_args.step_timeout
                    else "--step-timeout")
        self._shut_down(f"generation stuck: {what} has run for {seconds:.0f} s ({flag} "
                        f"{limit:g})")

    def _shut_down(self, reason: str):
        """The engine can't go on: /health says why, every request held or
        queued gets a 503 with the reason, and after --watchdog-grace seconds
        the process exits (status 70) for a supervisor to restart it (under
        mx.distributed: the whole group, every rank exits so)."""
        grace = getattr(self.cli_args, "watchdog_grace", 5.0)
        with self._shutting_down:  # (the watchdog and the generation thread)
            if self.hung:
                return
            self.hung = True
        self.unhealthy_reason = f"{reason}; the process exits in {grace:g} s"
        logging.critical(f"Watchdog: {self.unhealthy_reason}")
        error = self._unavailable()
        held = []
        try:
            held = self._held_channels()
        except Exception:  # the stuck thread changed them under us: best effort
            logging.exception("Watchdog: could not list every held request")
        for channel in held:
            channel.put(error)
            channel.cancel()
        self._fail_queue(error)
        self._fail_clear(error)
        time.sleep(grace)
        logging.critical(f"Watchdog: exiting with status {HANG_EXIT_STATUS}")
        logging.shutdown()
        self.exit_process(HANG_EXIT_STATUS)

    def _agree_on_the_store(self):
        """Under mx.distributed every rank's store must make the same
        decisions: the group keeps the smallest rank's budget (the default
        is a share of each host's memory), evicts as the rank with the most
        to give back (a pipeline rank holds its own layers' share of every
        entry), and reads rank 0's clock (for --prompt-cache-ttl and least
        recently used, as of the latest hand-off)."""
        store = self.store
        store.group_max = group_max
        store.set_clock(lambda: self.group_clock)
        store.max_bytes = -group_max([-store.max_bytes])[0]
        logging.info(f"Prompt cache budget {store.max_bytes / 1e6:.2f} MB, the smallest "
                     f"of the {self._group_size} ranks'")

    def relieve_memory(self):
        """After an allocation failure: give back half the prompt cache and
        MLX's buffer cache, so the next request has room."""
        self.store.trim_to(self.store.nbytes // 2, to_disk=False)
        gc.collect()
        mx.clear_cache()

    def _run(self):
        """The generation thread: run the loop, and restart it if it dies.

        Failures inside one request or one batch step are handled below this
        level. Anything that still escapes (a bug, a fault in MLX) lands here:
        every request the thread held gets an EngineUnavailable, /health says
        503 and new completions fail fast while the loop restarts with the
        model it had loaded. Past max_restarts crashes in restart_window
        seconds it stays down and says so, rather than crash-loop.
        """
        while not self._stop:
            try:
                self._generate()
                return
            except BaseException as e:
                self._idle()  # nothing runs now: not a stuck step
                if self.hung:
                    return  # the watchdog answers everyone and ends the process
                if self._is_distributed and self._stop and is_group_lost(e):
                    # Stopping anyway (the others were stopped with this one).
                    logging.warning(f"The distributed group ended while stopping: {e}")
                    self._fail_held(EngineUnavailable("server shutting down"))
                    self._fail_queue(EngineUnavailable("server shutting down"))
                    return
                if self._is_distributed:
                    # Every rank must take the same steps: a loop restarted
                    # on this rank alone would wait on the others forever.
                    what = group_end_reason(e)
                    logging.exception(f"mlx_lm_plus: {what}: {e!r}")
                    self._shut_down(f"{what}: {e}")
                    return
                logging.exception(f"mlx_lm_plus generation thread died: {e!r}")
                self.unhealthy_reason = f"generation thread died: {e!r}"
                self._fail_held(EngineUnavailable(f"generation engine failed: {e!r}"))
                now = time.monotonic()
                self._crash_times = [
                    t for t in self._crash_times if now - t < self.restart_window
                ] + [now]
                if len(self._crash_times) > self.max_restarts or not isinstance(e, Exception):
                    self.unhealthy_reason += " (not restarted: too many failures)"
                    self._fail_queue(EngineUnavailable(self.unhealthy_reason))
                    return
                time.sleep(self.restart_delay)
                if self.hung:
                    return
                self.restarts += 1
                logging.warning(f"Restarting the generation loop (restart {self.restarts})")
                self.unhealthy_reason = None

    def _held_channels(self) -> List[Channel]:
        """The channel of every request the generation thread has taken."""
        held = []
        for batch in list(self._batches.values()):
            held += [r["channel"] for r in list(batch.results.values())]
            held += [r[0] for r in batch.held_back()]
        held += [r[0] for r in list(self._pending)]
        held += [c for c in (self._current, self._admitting, self._handing_off)
                 if c is not None]
        return held

    def _fail_held(self, error: Exception):
        """Answer every request the generation thread had taken with `error`."""
        held = self._held_channels()
        for batch in self._batches.values():
            try:
                batch.close()
            except Exception:
                pass
        self._batches, self._pending, self._current, self._admitting = {}, [], None, None
        for channel in held:
            channel.put(error)
        gc.collect()

    def _fail_queue(self, error: Exception):
        while True:
            try:
                channel, _, _ = self.requests.get_nowait()
            except Empty:
                return
            channel.put(error)

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self.unhealthy_reason is None

    def _group_lost(self, e: BaseException) -> EngineUnavailable:
        """The 503 of a request held when the distributed group ended. /health
        says it from now on, before that request's client can ask (the
        thread's _shut_down then adds when the process exits)."""
        self.unhealthy_reason = f"{group_end_reason(e)}: {e}"
        return group_lost_error(e)

    def _unavailable(self) -> EngineUnavailable:
        return EngineUnavailable(
            f"Generation engine unavailable: {self.unhealthy_reason or 'not running'}"
        )

    def submit(self, channel, request, args):
        if not self.is_healthy:
            raise self._unavailable()
        if self._stop:
            raise EngineUnavailable("server shutting down")
        self.requests.put((channel, request, args))
        if self.hung:
            # The watchdog drained the queue before this put landed.
            self._fail_queue(self._unavailable())
        elif self._stop:  # (the loop may have drained its queue before this put)
            self._fail_queue(EngineUnavailable("server shutting down"))

    def clear_cache(self):
        """Drop every prompt cache entry; MLX's buffer cache follows on the
        generation thread. Returns the store's snapshot. Under mx.distributed
        every rank clears at the same hand-off (one store alone cleared would
        leave the others resuming prompts it recomputes)."""
        if not self._is_distributed:
            self.store.clear()
            self._clear_buffers = True
            return self.store.snapshot()
        if not self.is_healthy:
            raise self._unavailable()
        with self._clear_lock:
            if self._clear_wanted is None:
                self._clear_wanted = Future()
            cleared = self._clear_wanted
        try:
            cleared.result(timeout=60)  # (a hand-off comes every loop turn)
        except FutureTimeout:
            raise EngineUnavailable("Generation engine unavailable: the distributed group "
                                    "did not clear the prompt cache within 60 s")
        return self.store.snapshot()

    def _fail_clear(self, error: Exception):
        """A DELETE /v1/cache waiting for a hand-off that will not come."""
        with self._clear_lock:
            cleared, self._clear_wanted = self._clear_wanted, None
        if cleared is not None and not cleared.done():
            cleared.set_exception(error)

    def cache_snapshot(self) -> Dict[str, Any]:
        """The prompt cache's figures (safe from any thread)."""
        return self.store.snapshot()

    def observe(self, histogram: str, value: float):
        """A rare event for the metrics (a removal, a vision tower call)."""
        if self.metrics is not None:
            getattr(self.metrics, histogram).observe(value)

    def vision_stats(self) -> Optional[Dict[str, int]]:
        """Images through the vision tower and images served from the cache,
        over the loaded vision models (None when none is loaded)."""
        visions = [lm.processor for lm in list(self.model_provider.loaded.values())
                   if _serves_images(lm)]
        if not visions:
            return None
        return {"images_encoded": sum(v.calls for v in visions),
                "images_from_cache": sum(v.hits for v in visions)}

    @staticmethod
    def memory() -> Dict[str, int]:
        """MLX's allocator figures, in bytes (safe from any thread)."""
        return {
            "mlx_active_bytes": mx.get_active_memory(),
            "mlx_cache_bytes": mx.get_cache_memory(),
            "mlx_peak_bytes": mx.get_peak_memory(),
        }

    def models(self) -> List[Dict[str, Any]]:
        """The served set, then models loaded on request, each with whether it
        is loaded and what it holds (safe from any thread: /v1/models,
        /metrics, the dashboard)."""
        provider = self.model_provider
        now = time.monotonic()
        batches, loaded = dict(self._batches), dict(provider.loaded)
        served = {e.key for e in provider.served}
        loading = self._loading  # (read once: this thread may clear it meanwhile)
        loading = loading[0] if loading is not None else None
        out = []
        # One row per served entry (presets of one folder share its state),
        # then the models loaded on request.
        for entry, key in ([(e, e.key) for e in provider.served]
                           + [(None, k) for k in loaded if k not in served]):
            lm, batch = loaded.get(key), batches.get(key)
            active = (len(batch.results) if batch is not None else 0) + (
                self._current_key == key)
            out.append({
                "id": entry.name if entry is not None else key[0],
                "path": key[0],
                "loaded": lm is not None,
                "loading": key == loading,
                "pinned": lm.pinned if lm is not None else any(
                    e.pinned for e in provider.served if e.key == key),
                "weights_bytes": lm.nbytes if lm is not None else 0,
                "load_seconds": round(lm.load_seconds, 2) if lm is not None else None,
                "active_requests": active,
                "idle_seconds": (0.0 if active else round(now - lm.last_used, 1))
                if lm is not None else None,
                "keep_alive": lm.keep_alive if lm is not None else None,
            })
        return out

    def in_flight_nbytes(self) -> int:
        """Bytes of the caches the batches hold (see _Batch.owned_nbytes)."""
        return sum(b.owned_nbytes() for b in self._batches.values())

    @property
    def active_requests(self) -> int:
        """Requests the generation thread holds (in the batch or sequential)."""
        n = sum(len(b.results) for b in list(self._batches.values()))
        return n + (self._current is not None)

    def stop(self):
        """Stop the generation loop: every request it holds is answered
        ("server shutting down"), the prompt cache saved to disk (if any)."""
        self._stop = True

    def stop_and_join(self, timeout=None):
        self._stop = True
        self._thread.join(timeout)
        self._loader.shutdown(wait=False, cancel_futures=True)

    def join(self):
        self._thread.join()

    # -- distributed hand-off (rank 0 reads HTTP requests, all ranks compute) --

    def share_object(self, obj, site: int):
        """Rank 0's `obj` on every rank (None: nothing to share), at hand-off
        `site` (a number of its own for each place of the loop)."""
        if not self._is_distributed:
            return obj
        data = self._share(pickle.dumps(obj) if self._rank == 0 and obj is not None else b"",
                           site)
        return obj if self._rank == 0 or data is None else _unpickle(data)

    def _share(self, data: bytes, site: int) -> Optional[bytes]:
        """Rank 0's pickled `data` on every rank (None: none), after a header:
        each rank's count of hand-offs and `site`, checked alike on every
        rank (else the ranks went out of step: GroupDiverged ends the
        group); rank 0's clock (the one every rank's store reads); whether
        rank 0 stops; whether it was asked to clear the prompt cache."""
        self._handoffs += 1
        first = self._rank == 0
        clear = self._clear_wanted if first else None
        # (One all_sum carries it all: a count, or a site, is alike on every
        # rank when n * sum(x^2) == sum(x)^2; the count kept small, so no
        # sum overflows.)
        turn = self._handoffs % (1 << 20)
        size, turns, squares, sites, site_squares, clock, stop, clearing = \
            mx.distributed.all_sum(mx.array([
                len(data) if first else 0, turn, turn * turn, site, site * site,
                int(time.monotonic() * 1e6) if first else 0, int(self._stop) if first else 0,
                int(clear is not None)], dtype=mx.int64)).tolist()
        n = self._group_size
        if n * squares != turns * turns or n * site_squares != sites * sites:
            raise GroupDiverged(f"hand-off {self._handoffs} (at {site}) on rank "
                                f"{self._rank}: the ranks are at different ones")
        self.group_clock = clock / 1e6
        if stop:
            self._stop = self._group_stopped = True
        if clearing:  # (DELETE /v1/cache on rank 0)
            self.store.clear()
            self._clear_buffers = True
            if clear is not None:
                with self._clear_lock:
                    self._clear_wanted = None
                clear.set_result(True)
        if size == 0:
            return None
        payload = mx.array(memoryview(data)) if first else mx.zeros(size, dtype=mx.uint8)
        return bytes(memoryview(mx.distributed.all_sum(payload)))

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
        with self.requests.mutex:
            waiting = list(self.requests.queue)
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
        with self.requests.mutex:
            queue = self.requests.queue
            items = list(queue)
            before = [r for r in items if id(r) in self._placed]
            together = sorted((r for r in items if id(r) in work), key=lambda r: work[id(r)])
            later = [r for r in items if id(r) not in self._placed and id(r) not in work]
            queue.clear()
            queue.extend(before + together + later)
            present = {id(r) for r in items}
            self._placed = {id(r) for r in waiting if id(r) in present}

    def _work(self, request) -> Tuple[int, int]:
        planned = getattr(request[1], "planned", None)
        if planned is None:
            return 1, 0
        key = planned.plan.cache_key
        return 0, len(key) - self.store.covers(planned.model_key, key)

    def _next_request(self, timeout=None):
        request = None
        if not self._is_distributed or self._rank == 0:
            if len(self.requests.queue) > 1:  # (each request is sorted, and walked, once)
                self._order_arrivals()
            try:
                if timeout is not None:
                    request = self.requests.get(timeout=timeout)
                elif self.requests.queue:  # (a look without the lock, every step)
                    request = self.requests.get_nowait()
            except Empty:
                pass
            if request is not None:
                self._placed.discard(id(request))  # (its id may pass on to a new one)
        if not self._is_distributed:
            return request
        data = b""
        if request is not None:
            try:  # (before any collective: a request that can't be sent is its own error)
                data = pickle.dumps(request[1:])
                _unpickle(data)  # (as the other ranks will)
            except Exception as e:
                request[0].put(InternalError(f"Could not hand the request to the other "
                                             f"ranks: {e!r}"))
                request, data = None, b""
        # A collective: it waits for every rank (a dead one hangs it).
        self._beat("sharing requests with the other ranks")
        # Held here while it is handed off, so a lost group answers it.
        self._handing_off = request[0] if request is not None else None
        try:
            data = self._share(data, HANDOFF_REQUEST)
            # (Rank 0 keeps its own; the others get a sink for the channel.)
            shared = request[1:] if request is not None else (
                None if data is None else _unpickle(data))
        except Exception as e:
            if request is not None:
                request[0].put(self._group_lost(e))
            raise
        finally:
            self._handing_off = None
        if shared is None:
            return None
        channel = request[0] if request is not None else Channel()
        return (channel, *shared)

    # -- helpers --

    def _state_machine(self, model_key, tokenizer, stop_words):
        key = (model_key, tuple(stop_words))
        if key not in self._state_machines:
            if len(self._state_machines) > 100:
                self._state_machines.clear()
            self._state_machines[key] = (
                make_stop_sequences(tokenizer, stop_words),
                make_text_state_machine(tokenizer, stop_words),
                [(w, tuple(tokenizer.encode(w, add_special_tokens=False)))
                 for w in stop_words],
            )
        return self._state_machines[key]

    def _context(self, lm, plan, args):
        """(GenerationContext, StopSequences) of a planned request."""
        tokenizer = lm.tokenizer
        stop_sequences, text_sm, stop_word_tokens = self._state_machine(
            lm.key, tokenizer, args.stop_words)
        ctx = GenerationContext(
            has_tool_calling=tokenizer.has_tool_calling,
            has_thinking=tokenizer.has_thinking,
            tool_parser=tokenizer.tool_parser,
            text_sm=text_sm,
            initial_state=plan.initial_state,
            prompt=plan.tokens,
        )
        ctx.images = len(plan.vision.starts) if plan.vision is not None else 0
        # Which stop word ended a generation (Anthropic's stop_sequence).
        ctx.stop_word_tokens = stop_word_tokens
        return ctx, stop_sequences

    def _build_plan(self, lm, request, args) -> PromptPlan:
        kwargs = template_kwargs(self.cli_args.chat_template_args, args.chat_template_kwargs)
        try:
            check_prompt_size(prompt_chars(request, kwargs, lm.tokenizer.has_chat_template),
                              lm.context_length)
            return build_prompt(lm.tokenizer, lm.processor, request, kwargs)
        except Exception as e:
            raise PromptError(str(e) or type(e).__name__) from e

    @staticmethod
    def _constraint(request, tokenizer, plan):
        """The request's constraint processor (structured output), or None."""
        try:
            return processor_for(getattr(request, "constraint", None), tokenizer,
                                 plan.tokens, request.request_type == "chat")
        except ConstraintError as e:
            raise PromptError(str(e)) from e

    @staticmethod
    def _budget(request, args, tokenizer, plan, constraint):
        """The request's thinking budget's processor (reasoning.py), or None."""
        if not tokenizer.has_thinking:
            return None
        budget = thinking_budget(getattr(request, "thinking_budget", None), args.max_tokens,
                                 constraint is not None and constraint.after_think)
        if budget is None:
            return None
        return ThinkingBudget(budget, tokenizer, plan.tokens,
                              may_open=request.request_type == "chat")

    def plan(self, request, args) -> Optional[Planned]:
        """Plan a request for the model it names, on the caller's thread (the
        HTTP layer's planning thread): the template renders, tokenizing, the
        image processor and the constraint's matcher stay off the generation
        thread. None: the engine plans it at admission (that model not
        loaded yet, or images for one of mlx-lm's own vision models, served
        one at a time). Raises PromptError."""
        provider = self.model_provider
        key = provider.key_for(args.model)
        lm = provider.get(key)
        # (Under mx.distributed requests are pickled to the other ranks,
        # which plan them themselves.)
        if self._is_distributed or lm is None:
            return None
        images = request.request_type == "chat" and any(_image_parts(request.messages))
        if images and _own_vision(lm):
            return None
        # (A model without a processor refuses images here, in planning.)
        pixels = images and _serves_images(lm)
        if pixels:
            with self._image_lock:  # (planning lanes run side by side)
                if (len(self._image_plans) + self._image_planning
                        >= self.cli_args.prompt_concurrency):
                    return None
                self._image_planning += 1
        planned = None
        try:
            plan = self._build_plan(lm, request, args)
            constraint = self._constraint(request, lm.tokenizer, plan)
            planned = Planned(key, plan, constraint,
                              self._budget(request, args, lm.tokenizer, plan, constraint),
                              on_disk=self.store.disk_for(key) is not None)
        finally:
            if pixels:
                with self._image_lock:
                    self._image_planning -= 1
                    if planned is not None:
                        # The pixels are in the plan now: the request, which
                        # its handler holds to the end, lets the decoded ones
                        # go. (The plan leaves the set at admission, or when
                        # the client's going drops it.)
                        request.images = None
                        self._image_plans.add(planned)
        return planned

    def read_ahead(self, planned: Planned) -> Optional[Future]:
        """Read a planned request's entry from the disk tier on the caller's
        thread (an HTTP handler's executor), when it covers more of the
        prompt than memory: the generation thread then takes it from memory
        (PromptStore.read_ahead). Returns the Future of another handler's
        read of that entry, for the caller to wait for, or None. Errors are
        left to the fetch, which reads again and answers for them."""
        try:
            read = self.store.read_ahead(planned.model_key, planned.plan.cache_key)
        except Exception:
            logging.exception("Prompt cache: reading ahead from disk failed")
            return None
        return read if isinstance(read, Future) else None

    def _plan(self, lm, request, args) -> Planned:
        """The request's plan for model `lm`: the one made off this thread if
        it was made for that model, else made now."""
        planned = getattr(request, "planned", None)
        request.planned = None
        if planned is not None:
            # Admitted: no longer one planned ahead, however long something
            # holds it (a sequential request, until it ends).
            with self._image_lock:
                self._image_plans.discard(planned)
        if planned is None or planned.model_key != lm.key:
            self.planned_at_admission += 1
            try:
                plan = self._build_plan(lm, request, args)
            finally:
                # The decoded pixels are in the plan now (or not needed): the
                # request, which its handler holds to the end, lets them go.
                if getattr(request, "images", None) is not None:
                    request.images = None
            constraint = self._constraint(request, lm.tokenizer, plan)
            planned = Planned(lm.key, plan, constraint,
                              self._budget(request, args, lm.tokenizer, plan, constraint))
        return planned

    def _shared_depth(self, lm, plan: PromptPlan) -> Tuple[int, int]:
        """How far the store's paths follow this prompt (not into an image),
        and where a divergence checkpoint is worth storing (0: nowhere; see
        PromptStore.divergence)."""
        depth, worth_it = self.store.divergence(lm.key, plan.cache_key)
        if isinstance(plan.vision, VisionPrompt):
            depth = plan.vision.safe_prefix(depth)
        return depth, depth if worth_it else 0

    def _explain_miss(self, lm, plan: PromptPlan, reused: int) -> Optional[Dict[str, Any]]:
        """Why a request reused fewer prompt tokens than the store shares
        with it, or None: where its prompt departs from a stored sequence
        (the position, the part of the prompt, a few tokens of both sides
        there), and shared tokens it could not resume from. For the
        request's log line and /v1/stats (metrics.RequestRecord.cache_miss);
        api.py adds the message it found the departure in. A trie walk and
        three short decodes, on misses only."""
        try:
            return self._departure(lm, plan, reused)
        except Exception:  # (an explanation never fails a request)
            logging.exception("Prompt cache: explaining a miss failed")
            return None

    def _departure(self, lm, plan: PromptPlan, reused: int) -> Optional[Dict[str, Any]]:
        depth, stored = self.store.departure(lm.key, plan.cache_key)
        # (The last prompt token is fed with the first decode step: a stored
        # prompt is one token short of its key on some models.)
        unreused = depth - reused if depth - reused > 1 else 0
        if depth == 0 or not (stored or unreused):
            return None
        miss: Dict[str, Any] = {"position": depth, "reused": reused}
        if stored:
            ends = list(itertools.accumulate(map(len, plan.segments)))
            part = next(i for i, end in enumerate(ends) if depth < end or i == len(ends) - 1)
            miss["part"] = ("system prompt and tools" if plan.segment_types[part] == "system"
                            else "last message and generation prompt"
                            if part == len(ends) - 1 else "conversation")

            def text(ids):  # (an image's place in a cache key is a negative id)
                return lm.tokenizer.decode([i for i in ids if i >= 0])

            key = plan.cache_key
            miss["before"] = text(key[max(0, depth - 8):depth])
            miss["prompt"] = text(key[depth:depth + len(stored)])
            miss["stored"] = text(stored)
        if unreused:
            # Shared tokens the store could not resume from: models with
            # recurrent layers resume only where a whole state was stored.
            miss["shared_not_reused"] = unreused
        return miss

    @staticmethod
    def _split(plan: PromptPlan, depth: int):
        """The plan's segments, plus a divergence checkpoint at `depth`: where
        this prompt leaves the paths already in the store (an edit or
        regeneration inside a message), so the next variant of the same
        branch can resume there. Depends on the store, so it is found at
        admission (a trie walk)."""
        if not 0 < depth < len(plan.tokens) - 1:
            return plan.segments, plan.segment_types
        split = replace(plan, segments=list(plan.segments),
                        segment_types=list(plan.segment_types))
        split_at(split, depth)
        return split.segments, split.segment_types

    def _is_batchable(self, lm, request, args) -> bool:
        # Image requests batch on models served through mlx-vlm (vision.py);
        # on mlx-lm's own vision models they are served sequentially, as
        # upstream does; on text-only models they fail in planning (no
        # batch to drain for that).
        # --kv-bits batches through quantized_batch.py where every layer
        # upstream would quantize is a plain KVCache. (The messages are
        # scanned for images last: this runs every loop turn for requests
        # set aside.)
        return (
            lm.is_batchable
            and args.seed is None
            and (self.cli_args.kv_bits is None
                 or self._per_model(lm, "quantized batching", lambda: self._on_every_rank(
                     supports_quantized_batching(lm.model, self.cli_args.kv_group_size))))
            and (not _own_vision(lm) or not (
                request.request_type == "chat" and any(_image_parts(request.messages))))
        )

    def serves_vision(self, model) -> bool:
        """Whether image requests for `model` (a ModelDescription) are
        planned by vision.py (mlx-vlm models)."""
        key = self.model_provider.key_for(model)
        lm = self.model_provider.get(key)
        if lm is not None:
            return _serves_images(lm)
        return self.model_provider.is_vision(key)

    def image_max_pixels(self, model) -> Optional[int]:
        """The most pixels `model`'s image processor keeps (it scales larger
        images down), or None."""
        key = self.model_provider.key_for(model)
        lm = self.model_provider.get(key)
        if lm is not None and (vision := _vision(lm)) is not None:
            return vision.max_pixels
        return self.model_provider.image_max_pixels(key)

    def _resume(self, lm, plan, segments, cache, cached, channel, between_chunks=None):
        """A vision-language model's cache, ready for the rest of `plan`.

        A cached prefix may not end inside an image (its positions come out
        of the vision tower): cut back to before the image. The cache gets
        the M-RoPE delta of its end, whatever entry it came from. Then the
        images not covered yet go through the vision tower and are prefilled
        here (cancellable between chunks, with progress on `channel`); the
        rest of the prompt is text. Returns (cache, tokens reused from the
        store, tokens covered now). `between_chunks()`, if given, runs after
        each chunk (and the chunks are smaller while requests decode:
        prefill_chunk).
        """
        vision, model = _vision(lm), lm.model
        if vision is None:
            return cache, cached, cached
        images = plan.vision
        safe = images.safe_prefix(cached) if images is not None else cached
        if cache is not None and safe < cached:
            if self._on_every_rank(trims_to_any_prefix(cache)):
                trim_prompt_cache(cache, cached - safe)
            else:  # hybrid: its entries end at checkpoints, never in an image
                cache = None
        cached = safe if cache is not None else 0
        if cache is None:
            cache = make_prompt_cache(model)
        reused = cached
        if images is not None:
            vision.hits += sum(img.end <= cached for img in images.images)
        set_rope_delta(cache, images.delta_at(cached) if images is not None else 0)
        if images is not None and cached < images.end_of_images():
            tic = time.perf_counter()
            checkpoints = {}
            if self.keep_checkpoints(lm):
                ends = itertools.accumulate(len(s) for s in segments[0][:-1])
                checkpoints = dict(zip(ends, segments[1]))

            def store_checkpoint(position):
                kept = copy.deepcopy(cache)
                set_rope_delta(kept, images.delta_at(position))
                self._store(lm, plan.cache_key[:position], kept, checkpoints[position])

            step = self.cli_args.prefill_step_size
            progress = self._prefill_progress(channel, cache)
            if between_chunks is not None:
                step = prefill_chunk(step, self.decoding())

                def progress(done, total, own=progress):
                    between_chunks()
                    own(done, total)  # (then the watchdog's beat is the chunk's again)

            cached = vision.prefill(
                model, plan.tokens, images, cache, cached, step,
                checkpoints=checkpoints, on_checkpoint=store_checkpoint, progress=progress,
            )
            self.observe("vision_seconds", time.perf_counter() - tic)
        return cache, reused, cached

    def _prefill_progress(self, channel, cache):
        """The callback run between prefill chunks on this thread: a beat for
        the watchdog, a stop for a client that went away, a keepalive, and the
        byte budget against the request's growing cache."""
        def progress(done, total):
            self._beat("a prefill chunk")
            if self._gone(channel):
                raise _Cancelled(done)
            if self._stopping():
                raise EngineUnavailable("server shutting down")
            channel.put((done, total))
            self._tick()
            self.store.trim_to(self.store.max_bytes - cache_nbytes(cache))

        return progress

    def _attach_disk(self, lm):
        """With --prompt-cache-dir: the loaded model's disk tier, opened once
        per model (its index read, so conversations resume after a restart).

        Its folder is named by model_identity: the model's and the adapter's
        files, and what else shapes a stored cache (the store's --prompt-
        cache-bits, --kv-bits, a draft model, whose layers the sequential
        path's caches carry), so another model or setting never reads these
        entries. Not under mx.distributed (every rank holds a shard of the
        same identity)."""
        args = self.cli_args
        key = lm.key
        if (not getattr(args, "prompt_cache_dir", None)
                or self._is_distributed or self.store.disk_for(key) is not None):
            return
        from mlx_lm_plus.cache.disk import DiskTier, model_identity

        model, adapter, draft = key
        extra = f"bits={self.store.bits},group={self.store.group_size}"
        extra += weights_identity(getattr(lm, "weights_float32", False))
        if args.kv_bits is not None:
            extra += (f",kv_bits={args.kv_bits},kv_group={args.kv_group_size},"
                      f"kv_start={args.quantized_kv_start}")
        if draft is not None:
            extra += f",draft={model_identity(draft)}"
        try:
            # Queued writes hold arrays no budget counts: at most a quarter
            # of the memory budget (and the tier's own cap).
            tier = DiskTier(args.prompt_cache_dir, args.prompt_cache_disk_bytes,
                            model_identity(model, adapter, extra=extra),
                            max_queue_bytes=None if self.store.max_bytes is None
                            else max(1 << 20, self.store.max_bytes // 4))
        except Exception:  # the server goes on with the memory tier alone
            logging.exception("Prompt cache on disk disabled")
            return
        self.store.attach_disk(key, tier)
        s = tier.snapshot()
        logging.info(f"Prompt cache on disk: {s['directory']} ({s['entries']} entries, "
                     f"{s['bytes'] / 1e6:.1f}/{s['max_bytes'] / 1e6:.0f} MB"
                     + ("" if s["enabled"] else ", disabled") + ")")

    def _save_to_disk(self):
        """At shutdown, on this thread (the entries' arrays are its own):
        memory entries to the disk tiers, within --shutdown-timeout."""
        if getattr(self.cli_args, "prompt_cache_dir", None):
            self.store.save_to_disk(self.cli_args.shutdown_timeout)

    def _fetch_cache(self, lm, key):
        """(a private copy of the best cached prefix or None, tokens it covers)."""
        found = self.store.fetch(lm.key, key)
        return found.cache, found.cached

    def log_store(self):
        s = self.store.snapshot()
        logging.info(
            f"Prompt cache: {s['entries']} entries ({s['sequences']} sequences), "
            f"{s['bytes'] / 1e6:.1f}/{s['budget_bytes'] / 1e6:.0f} MB, hits {s['hits']}, "
            f"misses {s['misses']}, evictions {s['evictions']}, "
            f"tokens saved {s['prompt_tokens_saved']}"
            + (f"; on disk {s['disk']['entries']} entries, {s['disk']['bytes'] / 1e6:.1f} MB"
               if s.get("disk") else "")
        )

    def _store(self, lm, key, cache, kind, reply_start=0):
        # Speculative decoding leaves the model's and the draft's caches
        # behind the key, by different counts: cut all to the shortest (a
        # stored cache holds exactly its key's tokens).
        held = min((c.offset for c in cache if is_plain_kv(c)), default=len(key))
        if held < len(key) and all(is_plain_kv(c) for c in cache):
            for c in cache:
                c.trim(c.offset - held)
            key = key[:held]
        self.store_entry(lm.key, key, cache, kind, reply_start)

    def store_entry(self, model_key, key, cache, kind, reply_start=0):
        """Store a request's cache; a failure (out of memory) loses only
        that entry: the request, whose tokens went out, ends as it would
        have, and the batch goes on. (Under mx.distributed it raises: a
        step's error ends the whole group.)"""
        try:
            self.store.insert(model_key, key, cache, kind, reply_start=reply_start)
        except Exception:
            if self._is_distributed:
                raise
            logging.exception(f"Could not store a {kind} entry of {len(key)} tokens")

    def _per_model(self, lm, what: str, compute):
        """`compute()` once for model `lm` (a fact of the model that never
        changes, not worth working out per request)."""
        key = (lm.key, what)
        if key not in self._model_facts:
            self._model_facts[key] = compute()
        return self._model_facts[key]

    def keep_checkpoints(self, lm) -> bool:
        # (Pipeline ranks hold layers of their own kinds: where any needs
        # checkpoints, all store them alike.)
        return self._per_model(lm, "checkpoints", lambda: not self._on_every_rank(
            not self._needs_checkpoints(lm.model)))

    def _gone(self, channel) -> bool:
        """Whether the request's client went away. Only rank 0 sees it: under
        mx.distributed every rank asks at the same point (a collective) and
        gets rank 0's answer, so that all let the request go together."""
        if not self._is_distributed:
            return channel.cancelled
        return bool(group_max([channel.cancelled])[0])

    def _on_every_rank(self, fact: bool) -> bool:
        """Whether `fact`, true on this rank, is on every rank of the group
        (a pipeline rank judges its own layers; a collective)."""
        return fact if not self._is_distributed else not group_max([not fact])[0]

    @staticmethod
    def _needs_checkpoints(model) -> bool:
        """Whether message-boundary checkpoints are worth storing.

        When every layer is a plain KVCache, any prefix of a stored entry can
        be had by trimming it, so checkpoints would only cost memory. Hybrid
        (ArraysCache) and sliding-window (RotatingKVCache) layers can't be
        trimmed reliably: for them the checkpoints are what makes reuse work.
        """
        return not all(is_plain_kv(c) for c in make_prompt_cache(model))

    # -- the generation loop --

    def _generate(self):
        # All generation runs on this thread's stream, the same one the
        # distributed synchronisation uses.
        stream = mx.default_stream(mx.default_device())
        self._load_default()
        self._batches, self._pending = {}, []

        if self._is_distributed:
            self._beat("agreeing with the other ranks at the start")
            seed = mx.distributed.all_sum(mx.random.state[0]).view(mx.uint64).item()
            mx.random.seed(seed)
            self._agree_on_the_store()

        # (Under mx.distributed the ranks stop together, at the hand-off
        # that tells them rank 0 stops.)
        while not (self._group_stopped if self._is_distributed else self._stop):
            self._housekeeping()
            request = self._take_request()
            if request is not None:
                self._beat("admitting a request")
                # Held here while it is planned (and its images prefilled), so
                # a crash or the watchdog can answer it.
                self._admitting = request[0]
                try:
                    self._admit(request, stream)
                except Exception as e:
                    if self._is_distributed and ends_the_group(e):
                        request[0].put(self._group_lost(e))  # (no longer held below)
                        raise  # (the whole group is down: _run ends it)
                    # Whatever slipped past validation fails this request
                    # only, and it is answered.
                    logging.exception("Could not admit a request")
                    self._forget(request[0])
                    error = request_error(e, "admitting the request")
                    if isinstance(error, OutOfMemory):
                        self.relieve_memory()
                    request[0].put(error)
                finally:
                    self._admitting = None
                continue
            if self._await_arrivals():
                continue
            self._step_batches()

        self._fail_held(EngineUnavailable("server shutting down"))
        self._fail_queue(EngineUnavailable("server shutting down"))
        self._fail_loading(EngineUnavailable("server shutting down"))
        self._fail_clear(EngineUnavailable("server shutting down"))
        self._save_to_disk()
        self._fail_queue(EngineUnavailable("server shutting down"))  # (came meanwhile)
        self.model_provider.reset()
        gc.collect()

    def _await_arrivals(self) -> bool:
        """Before a prefill wave starts (requests admitted while no row
        decodes, so no stream waits for a token): if the HTTP side is still
        planning requests, wait a little for them (ARRIVAL_GAP for the next,
        WAVE_WAIT in all) so they join this wave instead of waiting for all
        of it. Returns whether one came (to be admitted first)."""
        since = self._wave_since
        if since is None or self._is_distributed or self.arrivals() <= 0 or self.decoding():
            self._wave_since = None
            return False
        wait = min(ARRIVAL_GAP, since + WAVE_WAIT - time.monotonic())
        queue = self.requests
        with queue.not_empty:
            came = wait > 0 and queue.not_empty.wait_for(lambda: bool(queue.queue), wait)
        if not came:
            self._wave_since = None
        return bool(came)

    def _step_batches(self):
        """One step of each active batch in turn: a busy model doesn't starve
        a quiet one. (A method of its own: a loop variable left in
        _generate's frame would keep an unloaded model's batch, and so its
        weights, alive.)"""
        for batch in [b for b in self._batches.values() if b.active]:
            if self._is_distributed:
                for _ in self._time_budget:
                    self._beat("a batch step")
                    if not batch.step():
                        break
            else:
                self._beat("a batch step")
                batch.step()
            # Their wait is over: first in line again.
            self._pending[:0] = batch.take_unparked()

    def decoding(self) -> bool:
        """Whether a request of any model is past its prompt (a prompt chunk
        of one model's batch stalls the streams of the others too)."""
        return any(b.decoding for b in self._batches.values())

    def _stopping(self) -> bool:
        """Whether a stop (SIGTERM) cuts short the request served one at a
        time: as the batch's are, once the shutdown timeout is over. (Under
        mx.distributed the ranks stop together, at the loop's turn.)"""
        return self._stop and not self._is_distributed

    def reset_random_state(self):
        """A fresh MLX random state after a failure: mlx-lm's samplers are
        compiled with the random state as input and output, and one that
        raises while it is traced (apply_top_k on a top_k it can't take)
        leaves that state a placeholder, and every sampled request after it
        failed ("eval an array without a primitive"). Not under
        mx.distributed, whose ranks must draw alike (a failure there ends
        the group anyway)."""
        if not self._is_distributed:
            mx.random.seed(time.time_ns() & (2**63 - 1))

    def _any_active(self) -> bool:
        return any(b.active for b in self._batches.values())

    def _take_request(self):
        """The next request to admit: the first one set aside that can go now,
        else a new one off the queue (set aside if it can't go yet). None
        when there is nothing to admit. A request set aside that is BLOCKED
        holds back every request after it (the running ones drain); one
        waiting for ROOM holds back all but those for pinned models (which
        are never the ones unloaded to make room)."""
        room_wait = False
        for request in list(self._pending):
            if room_wait and not self._for_pinned(request):
                continue
            state = self._readiness(request)
            if state is READY or isinstance(state, Exception):
                self._pending.remove(request)
                if state is READY:
                    return request
                request[0].put(state)
            elif state is BLOCKED:
                return None
            elif state is ROOM:
                room_wait = True
        busy = self._any_active()
        if not busy:
            self._idle()
        request = self._next_request(
            timeout=None if busy else 0.02 if self._loading is not None else 0.1)
        if request is None:
            return None
        # Held while it is placed (under mx.distributed its model may load
        # here), so that a crash or the watchdog answers it.
        self._admitting = request[0]
        try:
            state = LOADING if room_wait and not self._for_pinned(request) else \
                self._readiness(request)
        finally:
            self._admitting = None
        if state is READY:
            return request
        if isinstance(state, Exception):
            request[0].put(state)
        else:
            request[0].set_aside_at = time.monotonic()
            self._pending.append(request)
        return None

    def _key_of(self, request):
        """The model key a request names, or None where naming it raises
        (what slipped past validation: _readiness answers it)."""
        try:
            return self.model_provider.key_for(request[2].model)
        except Exception:
            return None

    def _for_pinned(self, request) -> bool:
        key = self._key_of(request)
        if key is None:
            return True  # (let _readiness answer it)
        lm = self.model_provider.get(key)
        return lm is not None and lm.pinned

    def _readiness(self, request):
        """READY, LOADING, ROOM or BLOCKED (see their definition), or the
        error the request gets. Starts the request's model loading when it isn't
        loaded and there is room."""
        try:
            return self._find_readiness(request)
        except Exception as e:  # (what slipped past validation: this request's)
            if self._is_distributed and ends_the_group(e):
                request[0].put(self._group_lost(e))
                raise  # (the whole group is down: _run ends it)
            logging.exception("Could not place a request")
            return request_error(e, "admitting the request")

    def _find_readiness(self, request):
        channel, req, args = request
        if self._gone(channel):
            return READY  # (_admit lets it go)
        provider = self.model_provider
        key = provider.key_for(args.model)
        lm = provider.get(key)
        if lm is None:
            if self._loading is not None:
                return LOADING
            unloadable = self._unloadable(request, key) if self._is_distributed else None
            if unloadable is not None:
                return unloadable  # (before the model loaded makes room for it)
            room = self._make_room(key)
            return self._start_load(key) if room is READY else room
        if getattr(req, "count_only", False) or self._is_batchable(lm, req, args):
            return READY
        # Served sequentially: it has the thread to itself.
        return BLOCKED if self._any_active() else READY

    def _in_use(self, key) -> bool:
        batch = self._batches.get(key)
        return batch is not None and (batch.active or bool(batch.held_back()))

    def _make_room(self, key):
        """READY when model `key` may be loaded now (idle models unloaded for
        it, least recently used first), ROOM while it must wait for a model
        to go idle, or the error its requests get when it never can (the
        models loaded are all pinned and fill --max-loaded-models)."""
        provider = self.model_provider
        extra = self.store.max_bytes or 0
        while not provider.fits(key, extra):
            idle = sorted((lm for lm in provider.loaded.values()
                           if not lm.pinned and not self._in_use(lm.key)),
                          key=lambda lm: lm.last_used)
            if idle:
                self._unload(idle[0].key, "to make room for " + key[0])
                mx.clear_cache()  # (its buffers go before the next model's come)
                continue
            if any(not lm.pinned for lm in provider.loaded.values()):
                return ROOM  # one of them will be idle
            if len(provider.loaded) >= max(1, self.cli_args.max_loaded_models):
                return ModelLoadError(
                    f"Model {key[0]!r} can't be loaded: the {len(provider.loaded)} "
                    f"loaded models are pinned and fill --max-loaded-models "
                    f"{self.cli_args.max_loaded_models}")
            logging.warning(f"Loading {key[0]} beyond the memory budget: the models "
                            "loaded are pinned")
            break
        return READY

    def _start_load(self, key):
        """Load `key`: on the loader thread (LOADING), or here under
        mx.distributed, where every rank must have it at the same step."""
        if self._is_distributed:
            # (A load that fails on one rank leaves the others in its
            # collectives: the group ends. _unloadable came first.)
            self._beat("loading a model", self._load_limit())
            try:
                lm = self.model_provider.load(key)
            except Exception as e:
                raise GroupDiverged(f"loading {key[0]} failed on rank {self._rank}: "
                                    f"{e!r}") from e
            self._loaded(lm)
            return READY
        logging.info(f"Loading model {key[0]} (requests for it wait; others go on)")
        self._loading = (key, self._loader.submit(self.model_provider.load, key),
                         time.monotonic())
        return LOADING

    def _unloadable(self, request, key) -> Optional[ModelLoadError]:
        """Under mx.distributed every rank must be able to load a model
        before any starts to (a load that fails on one rank leaves the others
        in its collectives): no adapter or draft model (not in distributed
        mode, as upstream), and on every rank a config.json (the same one),
        of a family mlx-lm has, and weights. Else a 404 on every rank, before
        the model loaded makes room. Looked at once per request (set aside,
        it is looked at again every loop turn, alike on every rank)."""
        channel = request[0]
        if getattr(channel, "loadable", None) == key:
            return None
        # (A Hugging Face repo's small files may be fetched: a load's limit.)
        self._beat("looking for a model on every rank", self._load_limit())
        problem, fingerprint = None, 0
        try:
            if key[1] is not None or key[2] is not None:
                raise ValueError("Loading with adapters or draft models not supported in "
                                 "distributed mode")
            fingerprint = loadable_fingerprint(key[0], pipeline=self.cli_args.pipeline)
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

    def _load_limit(self) -> tuple:
        """How long a load under mx.distributed may take (a rank lost during
        it leaves the others in its collectives)."""
        limit = self.cli_args.model_load_timeout
        return (limit, "--model-load-timeout") if limit else (math.inf, "")

    def _loaded(self, lm):
        self.model_provider.add(lm)
        self._attach_disk(lm)

    def _load_default(self):
        """The default model, loaded on this thread at the start (as upstream;
        not again after a restart of the loop: it may have been unloaded,
        and another model may be loading)."""
        key = self.model_provider.default_key
        if not self._started and key is not None and self.model_provider.get(key) is None:
            if self._is_distributed:  # (a lost rank stalls a load: watched)
                self._beat("loading the model", self._load_limit())
            else:
                self._idle()
            try:
                self._loaded(self.model_provider.load(key))
            except Exception:
                if self.cli_args.model is not None or self._is_distributed:
                    raise  # (--model: as upstream, the server has no model)
                # The first of --models-dir's folders or --models-config's
                # entries: the others still serve, and this one's requests
                # get its load error when they ask for it, as any other's.
                logging.exception(f"Loading {key[0]} at the start failed; serving the "
                                  "other models")
                self.model_provider.forget_size(key)
        self._started = True

    def _fail_pending(self, key, error):
        """Answer the requests set aside for model `key` with `error`."""
        kept, failed = [], []
        for r in self._pending:
            (failed if self._key_of(r) == key else kept).append(r)
        self._pending = kept
        for request in failed:
            request[0].put(error)

    def _fail_loading(self, error):
        if self._loading is not None:
            self._loading[1].cancel()
            self._fail_pending(self._loading[0], error)
            self._loading = None

    def _tick(self):
        """What can't wait for the loop while a request is served
        sequentially (called between its tokens and prefill chunks too): a
        finished or overdue load, keepalives to the requests set aside."""
        loading = self._loading
        if loading is not None and loading[1].done():
            (key, future, _), self._loading = loading, None
            try:
                self._loaded(future.result())
            except Exception as e:
                logging.exception(f"Loading {key[0]} failed")
                self.model_provider.forget_size(key)
                self._fail_pending(key, ModelLoadError(str(e)))
        now = time.monotonic()
        limit = self.cli_args.model_load_timeout
        if loading is not None and self._loading is loading and limit and \
                now - loading[2] > limit:
            # A stalled disk or download: its requests are answered, and the
            # next load gets a new loader thread (this one is left to end,
            # its model dropped).
            key = loading[0]
            logging.error(f"Loading {key[0]} has taken more than {limit:g} s "
                          "(--model-load-timeout): given up")
            self._loading = None
            self._loader.shutdown(wait=False)
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="mlx_lm_plus-loader")
            self.model_provider.forget_size(key)
            self._fail_pending(key, ModelLoadError(
                f"Loading {key[0]} took more than {limit:g} s (--model-load-timeout)"))
        # A keepalive once a request has waited KEEPALIVE_EVERY (a stream's
        # headers go then: a short wait keeps its real status code); parked
        # ones too, which may wait for another request's whole prefill.
        held = [r for b in self._batches.values() for r in b.held_back()]
        for request in self._pending + held:
            channel = request[0]
            since = getattr(channel, "set_aside_at", None)
            if since is not None and now - since >= KEEPALIVE_EVERY:
                channel.set_aside_at = now
                channel.put((0, 0))

    def _housekeeping(self):
        """`_tick`; idle models past their TTL or keep_alive are unloaded;
        MLX's buffer cache is cleared after DELETE /v1/cache once nothing
        runs."""
        loading = self._loading
        now = time.monotonic()
        if now - self._housekept < HOUSEKEEPING_EVERY and (
                loading is None or not loading[1].done()):
            return  # (a finished load is taken at once: its requests wait)
        self._housekept = now
        self._tick()
        self.store.drop_stale_read_ahead()  # (a quiet server lets them go too)
        if self._clear_buffers and not self._any_active():
            self._clear_buffers = False
            gc.collect()
            mx.clear_cache()
        if self._unloaded and not self._any_active() and not self._pending:
            # An unloaded model's buffers back to the system (its weights went
            # with their last reference: no cycles, so no gc.collect, which
            # holds the GIL ~50 ms).
            self._unloaded = False
            mx.clear_cache()
        if self._is_distributed:
            return  # (a clock differs between ranks: their models must not)
        ttl = self.cli_args.model_ttl
        waiting = self._waiting_for()
        for lm in list(self.model_provider.loaded.values()):
            if self._in_use(lm.key) or self._current_key == lm.key or lm.key in waiting:
                lm.last_used = now
                continue
            limit = lm.idle_limit(ttl)
            if limit is not None and now - lm.last_used >= limit:
                self._unload(lm.key, f"idle for {now - lm.last_used:.0f} s")

    def _waiting_for(self):
        """The models that requests set aside are for."""
        return {self._key_of(request) for request in self._pending}

    def _unload(self, key, why: str):
        batch = self._batches.pop(key, None)
        if batch is not None:
            # (Never with requests in it: _in_use. Were it so, they are
            # answered rather than left waiting.)
            for r in batch.results.values():
                r["channel"].put(EngineUnavailable(f"Model {key[0]} was unloaded"))
            batch.close()
        self.model_provider.unload(key, why)
        self._state_machines = {k: v for k, v in self._state_machines.items()
                                if k[0] != key}
        # Its weights go with the last reference; MLX's buffer cache is
        # cleared once nothing runs or waits.
        self._unloaded = True

    def _admit(self, request, stream):
        """Admit a request whose model is loaded: into that model's batch
        (started if it has none), or the sequential path."""
        channel, req, args = request
        if self._gone(channel):
            channel.removed()
            return
        lm = self.model_provider.get(self.model_provider.key_for(args.model))
        lm.last_used = time.monotonic()
        if getattr(req, "keep_alive", None) is not None:
            lm.keep_alive = req.keep_alive
        if getattr(req, "count_only", False):
            self._count(lm, channel, req, args)
            return
        if lm.vocab_size is not None:  # (checked by the API when it was loaded)
            try:
                check_vocab(args.sampling.top_k, args.logits.logit_bias, lm.vocab_size)
            except RequestError as e:
                channel.put(PromptError(str(e)))
                return
        if not self._is_batchable(lm, req, args):
            self._current, self._current_key = channel, lm.key
            try:
                self._serve_single(lm, channel, req, args, stream)
            finally:
                self._current = self._current_key = None
            return
        batch = self._batches.get(lm.key)
        if batch is None:
            batch = self._batches[lm.key] = _Batch(self, lm, stream)
        tic = time.perf_counter()
        stepped = 0.0  # (seconds of batch steps run inside the admission)

        def between_chunks():
            """Between two chunks of an image stretch every batch takes a
            step, as between a text prompt's chunks: their streams don't
            wait for all the image. (Not under mx.distributed, where any
            error of a batch step must end the group, not this request.)"""
            nonlocal stepped
            step_tic = time.perf_counter()
            self._step_batches()
            stepped += time.perf_counter() - step_tic

        admission = self._prepare(
            lm, channel, req, args, batch=(batch, request),
            between_chunks=None if self._is_distributed else between_chunks)
        if admission is not PARKED:
            if admission is not None:
                batch.insert(admission)
                if self._wave_since is None and not self.decoding():
                    self._wave_since = time.monotonic()
            self.admitted += 1
        self.thread_seconds["admission"] += time.perf_counter() - tic - stepped

    def _prepare(self, lm, channel, request, args, batch=None, between_chunks=None):
        """A request's admission into the batch: its plan, its cached prefix
        and, on vision-language models, its images through the vision tower
        and prefilled (unless the cache covers them; `between_chunks`: see
        _resume). Errors that are the request's own are answered here
        (None); others raise for the admission guard. `batch`: (the _Batch,
        the request as queued), which may hold it back before anything is
        fetched (PARKED), and whose requests may store its divergence
        checkpoint already."""
        try:
            planned = self._plan(lm, request, args)
        except PromptError as e:
            channel.put(e)
            return None
        plan = planned.plan
        depth, divergence = self._shared_depth(lm, plan)
        if batch is not None:
            if batch[0].park(batch[1], planned, depth):
                return PARKED
            if batch[0].will_store(plan.cache_key, divergence):
                divergence = 0  # (another request of the batch stores it)
        segments = self._split(plan, divergence)
        cache, cached = self._fetch_cache(lm, plan.cache_key)
        ctx, stop_sequences = self._context(lm, plan, args)
        ctx.prompt_cache_count = cached
        if _vision(lm) is not None:
            try:
                cache, ctx.prompt_cache_count, cached = self._resume(
                    lm, plan, segments, cache, cached, channel, between_chunks)
            except _Cancelled as stopped:
                channel.removed()
                logging.info(f"Stopped the image prefill of a cancelled request at prompt "
                             f"token {stopped.args[0]}")
                return None
            except Exception as e:
                if self._is_distributed and ends_the_group(e):
                    raise  # (the admission guard answers it; _run ends the group)
                logging.exception("Image prefill failed")
                if is_out_of_memory(e):
                    raise  # the admission guard answers 503
                channel.put(PromptError(f"Could not process the images: {e}"))
                return None
        ctx.cache_miss = self._explain_miss(lm, plan, ctx.prompt_cache_count)
        return Admission(channel, args, plan, ctx, stop_sequences, cache, cached,
                         *segments, planned.constraint, planned.budget)

    def _count(self, lm, channel, request, args):
        """Plan a request and answer its context only: the prompt's size, as
        the same request would be generated (count_tokens)."""
        plan = self._plan(lm, request, args).plan  # PromptError: the guard answers
        ctx, _ = self._context(lm, plan, args)
        ctx.prompt_cache_count = 0
        channel.put(ctx)
        channel.put(None)

    def count_prompt(self, request, args) -> Optional[int]:
        """The prompt size of a request for a loaded model, planned on the
        caller's thread (count_tokens: the template and the image processor
        never run between batch steps). None: not answerable here (that
        model not loaded, or images for one of mlx-lm's own vision models)."""
        lm = self.model_provider.get(self.model_provider.key_for(args.model))
        if lm is None or (_own_vision(lm) and request.request_type == "chat"
                          and any(_image_parts(request.messages))):
            return None
        # A copy: templating converts the messages in place (the decoded
        # images are only read: not copied).
        images = getattr(request, "images", None)
        plan = self._build_plan(lm, copy.deepcopy(request, {id(images): images}), args)
        return len(plan.tokens)

    def _forget(self, channel):
        """Drop every reference the generation thread holds to `channel`."""
        self._pending = [r for r in self._pending if r[0] is not channel]
        if self._current is channel:
            self._current = None

    def _serve_single(self, lm, channel, request, args, stream):
        """Sequential path: seed, draft model, images (and --kv-bits on models
        quantized_batch.py does not batch), and every request for a model
        served through mlx-vlm's own generation (vlm_generation.py)."""
        tic = time.perf_counter()
        self.admitted += 1
        try:
            tokenizer, draft_model = lm.tokenizer, lm.draft_model
            planned = self._plan(lm, request, args)
            plan, constraint = planned.plan, planned.constraint
            ctx, stop_sequences = self._context(lm, plan, args)
            if args.seed is not None:
                mx.random.seed(args.seed)
            sampler = _make_sampler(args, tokenizer)
            logits_processors = _make_logits_processors(args)
            if constraint is not None and draft_model is not None:
                # Speculation runs the processors on draft tokens it may
                # reject; a matcher can't follow that.
                raise PromptError(
                    "Structured output (response_format, a forced tool_choice) is not "
                    "available with a draft model (--draft-model)")
            if planned.budget is not None and draft_model is not None:
                warn_once("budget with a draft model", (
                    "A request asked for a thinking budget on a model served with a draft "
                    "model (--draft-model): not applied (speculation calls the processors "
                    "on draft tokens it may reject, which a count can't follow)"))
            elif planned.budget is not None:
                logits_processors.append(planned.budget)
            if constraint is not None:
                logits_processors.append(constraint)

            cache_key = plan.cache_key
            through_mlx_vlm = isinstance(lm.processor, MlxVlmGeneration)
            if through_mlx_vlm:
                cache, generation = self._mlx_vlm_generation(
                    lm, channel, plan, ctx, args, sampler, logits_processors)
            else:
                cache, generation = self._mlx_lm_generation(
                    lm, channel, plan, ctx, args, stream, sampler, logits_processors)

            stop_matcher = stop_sequences.matcher()
            cut_short = None  # the engine stopping cuts it short: its error
            seconds = self.thread_seconds
            seconds["admission"] += time.perf_counter() - tic
            tic = time.perf_counter()
            for gen in generation:
                toc = time.perf_counter()
                seconds["model"] += toc - tic
                self.tokens_out += 1
                finish_reason = gen.finish_reason
                if stop_matcher.advance(gen.token):
                    finish_reason = "stop"
                channel.put(
                    Response(
                        gen.text,
                        gen.token,
                        _logprob(gen.logprobs[gen.token].item()) if args.logprobs else 0.0,
                        finish_reason,
                        _format_top_logprobs(gen.logprobs, args.top_logprobs, tokenizer),
                    )
                )
                cache_key.append(gen.token)
                self._beat("a decode step")
                if self._pending and self.steps % BUDGET_EVERY == 0:
                    self._tick()
                self.steps += 1
                if self.steps % BUDGET_EVERY == 0:
                    # The budget covers this request's growing cache too.
                    self.store.trim_to(self.store.max_bytes - cache_nbytes(cache))
                gone = ctx._should_stop or channel.cancelled
                if self._is_distributed:
                    # Only rank 0 sees the client: every rank stops at the
                    # same token, looked at every BUDGET_EVERY (a collective).
                    gone = self.steps % BUDGET_EVERY == 0 and bool(group_max([gone])[0])
                tic = time.perf_counter()
                seconds["outside_model"] += tic - toc
                if gone and finish_reason is None:
                    logging.info(f"Stopped a cancelled request at step {self.steps}")
                if gone or finish_reason is not None:
                    break
                if self._stopping():
                    cut_short = EngineUnavailable("server shutting down")
                    break
            if channel.cancelled:
                channel.removed()
            # Stored before the answer ends, so that a follow-up sent the
            # moment it ends finds it.
            if not through_mlx_vlm:  # (nothing of that path is stored)
                self._store(lm, cache_key, cache, "generated", reply_start=len(plan.tokens))
            if cut_short is not None:
                channel.put(cut_short)
                return
            if constraint is not None and constraint.error is not None:
                channel.put(InternalError(f"Structured output failed: {constraint.error}"))
            channel.put(None)
            self.log_store()
        except EngineUnavailable as e:  # (stopping during its prefill)
            channel.put(e)
        except _Cancelled as stopped:
            channel.removed()
            after = ""
            if channel.cancelled_at is not None:  # (rank 0's: it saw the client go)
                waited = channel.removed_at - channel.cancelled_at
                self.observe("removal_seconds", waited)
                after = f", {waited * 1000:.1f} ms after the disconnect"
            logging.info(f"Stopped the prefill of a cancelled request at prompt token "
                         f"{stopped.args[0]}{after}")
        except Exception as e:
            if self._is_distributed and ends_the_group(e):
                raise  # (the admission guard answers it; _run ends the group)
            logging.exception("Sequential generation failed")
            error = request_error(e, "generating")
            self.reset_random_state()
            if isinstance(error, OutOfMemory):
                cache = None
                self.relieve_memory()
            channel.put(error)

    def _mlx_lm_generation(self, lm, channel, plan, ctx, args, stream, sampler,
                           logits_processors):
        """(cache, responses) of the sequential path on mlx-lm's generation:
        the cached prefix, the images and checkpoints prefilled here, the
        rest in stream_generate."""
        model, tokenizer, draft_model = lm.model, lm.tokenizer, lm.draft_model
        segments = self._split(plan, self._shared_depth(lm, plan)[1])
        vision_support = _vision(lm)
        cache, ctx.prompt_cache_count = self._fetch_cache(lm, plan.cache_key)
        covered = ctx.prompt_cache_count
        if vision_support is not None:
            cache, ctx.prompt_cache_count, covered = self._resume(
                lm, plan, segments, cache, covered, channel
            )
        rest = plan.tokens[covered:]
        if cache is None:
            cache = make_prompt_cache(model)
            if draft_model is not None:
                cache += make_prompt_cache(draft_model)
        ctx.cache_miss = self._explain_miss(lm, plan, ctx.prompt_cache_count)
        channel.put(ctx)

        progress = self._prefill_progress(channel, cache)

        if draft_model is None and (plan.vision is None or vision_support is not None):
            rest = self._prefill_checkpoints(lm, cache, plan, segments, covered,
                                             progress)

        input_embeddings = None
        vision = plan.vision
        if vision is not None and vision_support is None:  # mlx-lm's own vision models
            n = sum(i < ctx.prompt_cache_count for i in vision.starts)
            if pixel_values := vision.pixel_values[n:]:
                tic = time.perf_counter()
                input_embeddings = model.embed_inputs(
                    mx.array(rest), pixel_values=pixel_values
                )
                mx.eval(input_embeddings)
                self.observe("vision_seconds", time.perf_counter() - tic)

        fed = len(plan.tokens) - len(rest)  # (cached, and prefilled to checkpoints here)
        # (Speculative decoding hands its processors no prompt at all, cached
        # or not, but the last token: nothing to add there.)
        if logits_processors and fed and draft_model is None:
            logits_processors = [_with_prompt(logits_processors, plan.tokens[:fed], False)]
        return cache, stream_generate(
            model=model,
            stream=stream,
            tokenizer=tokenizer,
            prompt=rest,
            max_tokens=args.max_tokens,
            sampler=sampler,
            logits_processors=logits_processors,
            prompt_cache=cache,
            draft_model=draft_model,
            num_draft_tokens=args.num_draft_tokens,
            input_embeddings=input_embeddings,
            prompt_progress_callback=progress,
            prefill_step_size=self.cli_args.prefill_step_size,
            kv_bits=self.cli_args.kv_bits,
            kv_group_size=self.cli_args.kv_group_size,
            quantized_kv_start=self.cli_args.quantized_kv_start,
        )

    def _mlx_vlm_generation(self, lm, channel, plan, ctx, args, sampler, logits_processors):
        """(cache, responses) of a model served through mlx-vlm's own
        generation: the whole prompt into an empty cache, never stored (its
        bytes count against the budget while it runs). The logits processors
        see the prompt and the tokens so far, as on mlx-lm's paths (mlx-vlm
        hands them only what it fed since its prefill)."""
        ctx.prompt_cache_count = 0
        channel.put(ctx)
        self._beat("an mlx-vlm prefill")  # (the vision tower runs before its first chunk)
        cache = lm.processor.make_cache()
        pairs = lm.processor.generate(
            plan.tokens, plan.vision, cache, sampler,
            [_with_prompt(logits_processors, plan.tokens, True)] if logits_processors else [],
            args.max_tokens, self.cli_args.prefill_step_size,
            progress=self._prefill_progress(channel, cache), kv_bits=self.cli_args.kv_bits,
            kv_group_size=self.cli_args.kv_group_size,
            quantized_kv_start=self.cli_args.quantized_kv_start)
        return cache, responses(lm.tokenizer, pairs, len(plan.tokens), args.max_tokens)

    def _prefill_checkpoints(self, lm, cache, plan, segments, cached, progress):
        """Sequential path: prefill up to each checkpoint and store a copy there.

        The positions the batched path stores: the ends of `segments` (the
        plan's, with the divergence checkpoint) and the end of the prompt but
        its last token. Returns the tokens left for stream_generate.
        """
        segments, kinds = _drop_cached(*segments, cached)
        if not self.keep_checkpoints(lm):
            return plan.tokens[cached:]
        model = lm.model
        if len(segments[-1]) > 1:  # kinds already has one entry per end
            last = segments.pop()
            segments += [last[:-1], last[-1:]]
        done, total = cached, len(plan.tokens)
        args = self.cli_args
        step = args.prefill_step_size
        for segment, kind in zip(segments[:-1], kinds):
            for i in range(0, len(segment), step):
                model(mx.array(segment[i : i + step])[None], cache=cache)
                # --kv-bits: as generate_step's prefill does after each chunk
                # (the checkpoints stored quantized, the memory bounded).
                maybe_quantize_kv_cache(cache, args.quantized_kv_start, args.kv_group_size,
                                        args.kv_bits)
                mx.eval([c.state for c in cache])
                progress(done + min(i + step, len(segment)), total)
            done += len(segment)
            self._store(lm, plan.cache_key[:done], copy.deepcopy(cache), kind)
        return segments[-1]


def prefill_chunk(step_size: int, decoding: bool) -> int:
    """Tokens per prompt chunk: --prefill-step-size, or a share of it while
    other requests decode (DECODING_CHUNK_DIVISOR)."""
    if not decoding:
        return step_size
    return min(step_size, max(DECODING_CHUNK_MIN, step_size // DECODING_CHUNK_DIVISOR))


def _with_prompt(processors, head: List[int], repeated_tail: bool):
    """One logits processor running `processors` in turn on the whole
    context, `head` + what the generation loop passes:
      * mlx-lm's generate_step passes the prompt it was given (the part
        the cache did not cover) and the tokens since: head is the cached
        part (`repeated_tail` False);
      * mlx-vlm's passes the prompt's tail it fed last, the same at every
        step, and the tokens since: head is the whole prompt, and that
        tail (the first call's tokens) is left out (`repeated_tail`).
    Penalties (repetition, presence, frequency) then count the same tokens
    cached or cold, as on the batched path (all_tokens)."""
    tail = first = None

    def process(tokens, logits):
        nonlocal tail, first
        if first is None:
            tail = tokens.size if repeated_tail else 0
            first = mx.array(head, tokens.dtype)
        context = mx.concatenate([first, tokens[tail:]])
        for processor in processors:
            logits = processor(context, logits)
        return logits
    return process


def _serves_images(lm) -> bool:
    """Whether a loaded model takes image parts (through mlx-vlm, batched by
    vision.py or one at a time by vlm_generation.py)."""
    return isinstance(lm.processor, (VisionSupport, MlxVlmGeneration))


def _own_vision(lm) -> bool:
    """Whether a loaded model is one of mlx-lm's own vision models (a
    processor, not mlx-vlm's): their image requests are planned at
    admission and served one at a time, as upstream does. (A model without
    a processor refuses images when they are planned.)"""
    return lm.processor is not None and not _serves_images(lm)


def _vision(lm) -> Optional[VisionSupport]:
    """A model's vision support (mlx-vlm models), or None."""
    return lm.processor if isinstance(lm.processor, VisionSupport) else None


class _Batch:
    """A BatchGenerator and the requests in it, for one model."""

    def __init__(self, engine: Engine, lm, stream):
        # What it uses of the engine: store, cli_args, the counters (steps,
        # tokens_out, thread_seconds), share_object, observe, log_store,
        # relieve_memory, in_flight_nbytes, decoding, reset_random_state and
        # store_entry.
        self.engine = engine
        self.model = lm.model
        self.tokenizer = lm.tokenizer
        self.stream = stream
        self.model_key = lm.key
        self.keep_checkpoints = engine.keep_checkpoints(lm)
        self.results: Dict[int, Dict[str, Any]] = {}
        self._outbox = []  # (channel, event) of the step running
        self._samplers = {}  # sampling settings -> sampler (see _sampler)
        # Requests waiting for a checkpoint another request in the batch is
        # about to store: [leader uid, position, the request as queued]; and
        # those whose wait is over, for the engine to admit again.
        self._parked: List[list] = []
        self._unparked: List[tuple] = []
        # Steps to run without a prompt chunk, so that a request's first
        # token is handed out before one (see _step), and how many ran in a
        # row (at most FIRST_TOKEN_STEPS: prompts keep going in).
        self._decode_only = 0
        self._decode_only_run = 0
        self._new_generator()

    def _new_generator(self):
        args = self.engine.cli_args
        generator, kv = BatchGenerator, {}
        if args.kv_bits is not None:  # a batched quantized KV cache
            generator = QuantizedBatchGenerator
            kv = dict(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                      quantized_kv_start=args.quantized_kv_start)
        elif self.keep_checkpoints and not self.engine._is_distributed:
            # Recurrent states at checkpoints inside a chunk (taps.py).
            recorder = taps.install(self.model)
            if recorder is not None:
                generator, kv = taps.TappingBatchGenerator, dict(recorder=recorder)
        self.tapping = generator is taps.TappingBatchGenerator
        self.generator = generator(
            self.model,
            completion_batch_size=args.decode_concurrency,
            prefill_batch_size=args.prompt_concurrency,
            prefill_step_size=args.prefill_step_size,
            stream=self.stream,
            **kv,
        )

    @property
    def active(self) -> bool:
        return bool(self.results)

    def close(self):
        self.generator.close()

    def _sampler(self, args):
        """One sampler per distinct setting: rows that share it are sampled
        by one call per step (BatchGenerator batches rows whose sampler is
        the same object; a sampler holds no state of its own). Not with XTC,
        whose one random draw per call would then decide for all the rows."""
        s = args.sampling
        if s.xtc_probability > 0:
            return _make_sampler(args, self.tokenizer)
        key = (s.temperature, s.top_p, s.top_k, s.min_p)
        sampler = self._samplers.get(key)
        if sampler is None:
            if len(self._samplers) > 64:
                self._samplers.clear()
            sampler = self._samplers[key] = _make_sampler(args, self.tokenizer)
        return sampler

    def insert(self, a: Admission):
        """Add an admitted request to the generator."""
        segments, segment_types = _drop_cached(a.segments, a.segment_types, a.cached)
        if not self.keep_checkpoints:
            # Plain KV caches: any prefix of an entry serves by trimming, so
            # no checkpoints but the end of the system messages, where
            # concurrent requests that share them wait for this one (park).
            head = int(len(segments) > 1 and segment_types[0] == "system")
            segments = segments[:head] + [sum(segments[head:], [])]
            segment_types = segment_types[:head] + ["prompt"]
        # The positions of the checkpoints this request will store.
        ends = list(itertools.accumulate((len(s) for s in segments[:-1]), initial=a.cached))[1:]
        tapped = {}
        if self.tapping and len(segments) > 1:
            # One segment: the generator cuts its last token off, and that end
            # (the last checkpoint) stays a segment end; the checkpoints
            # before it are taken inside the chunks that pass them.
            checkpoints = list(zip(ends, segment_types))
            if len(segments[-1]) > 1:
                checkpoints.append((a.cached + sum(map(len, segments)) - 1, segment_types[-1]))
            segment_types = [checkpoints.pop()[1]]
            segments = [sum(segments, [])]
            tapped = dict(checkpoints)
        more = dict(taps=[list(tapped)]) if self.tapping else {}
        processors = (_make_logits_processors(a.args) + ([a.budget] if a.budget else [])
                      + ([a.constraint] if a.constraint else []))
        if sum(map(len, segments)) == 1:  # (its prompt is in but its last token)
            self._decode_only = FIRST_TOKEN_STEPS
        # (An error here is answered by the engine's admission guard.)
        (uid,) = self.generator.insert_segments(
            segments=[segments],
            max_tokens=[a.args.max_tokens],
            caches=[a.cache],
            all_tokens=[a.plan.tokens[:a.cached]],
            samplers=[self._sampler(a.args)],
            logits_processors=[processors],
            stop_sequences=[a.stop_sequences],
            **more,
        )
        a.channel.put(a.ctx)
        self.results[uid] = {
            "ctx": a.ctx,
            "channel": a.channel,
            "detokenizer": self.tokenizer.detokenizer,
            # Popped from the end as segment ends are reached.
            "segment_types": segment_types[::-1],
            "ends": ends,  # those not reached yet
            "taps": tapped,  # position -> kind, of those taken inside a chunk
            "logprobs": a.args.logprobs,
            "top_logprobs": a.args.top_logprobs,
            "decoding": False,  # set at its first generated token
            # Cache keys of this request: the prompt's key (image ids in
            # place of image tokens), then the tokens it generates.
            "key_prefix": a.plan.cache_key,
            # Structured output: a grammar failure fails this request alone.
            "constraint": a.constraint,
            # Its images prefilled at admission (_resume): a cache of its
            # own, counted in flight while it waits in the generator's queue.
            "prefilled": a.cached > a.ctx.prompt_cache_count,
        }

    def step(self) -> bool:
        """One BatchGenerator step. Returns whether it did any work.

        Anything raised inside, removing cancelled requests included, fails
        the requests of this batch, not the generation thread (under
        mx.distributed it ends the group: the error may be one rank's).
        """
        tic = time.perf_counter()
        seconds = self.engine.thread_seconds
        model = seconds["model"]
        try:
            self._remove_stopped()
            return self._step()
        except Exception as e:
            if self.engine._is_distributed:
                # (A step's error may be one rank's: its own layers, its
                # memory. The others went on: the whole group ends.)
                raise
            self._flush()  # what the step produced comes before the error
            self._fail_all(e)
            return False
        finally:
            self._flush()
            seconds["outside_model"] += time.perf_counter() - tic - (seconds["model"] - model)

    def _flush(self):
        """Hand the step's events to their channels at once (the HTTP side:
        one call into the event loop per step, not one per token)."""
        if self._outbox:
            events, self._outbox = self._outbox, []
            deliver(events)

    def _remove_stopped(self):
        """Clients that went away leave the batch wherever they are."""
        engine = self.engine
        if not engine._is_distributed:  # (there, rank 0 alone sees a client go)
            # Parked behind another request's checkpoint: let go now (the
            # engine's admission drops it), not once that checkpoint is in.
            gone = [p for p in self._parked if p[2][0].cancelled]
            if gone:
                self._parked = [p for p in self._parked if not p[2][0].cancelled]
                self._unparked += [p[2] for p in gone]
        stopped = [
            uid
            for uid, r in self.results.items()
            if r["ctx"]._should_stop or r["channel"].cancelled
        ]
        # (Rank 0's, on every rank: they leave the batch at the same step.)
        stopped = engine.share_object(stopped or None, HANDOFF_STOPPED)
        if not stopped:
            return
        # Work done for a request in decode stays useful: its cache covers
        # its prompt and the tokens generated so far, as at a normal end.
        decoding = [uid for uid in stopped if self.results[uid]["decoding"]]
        kept = self.generator.remove(stopped, return_prompt_caches=True)
        waits = []
        for uid in stopped:
            if uid in decoding:
                cache, tokens = kept[uid]
                self._insert(self._key(uid, tokens), cache, "generated",
                             reply_start=self._reply_start(uid))
            result = self.results.pop(uid, None)
            self._unpark(uid)
            if result is None:
                continue
            channel = result["channel"]
            channel.removed()
            if channel.cancelled_at is not None:
                waits.append(channel.removed_at - channel.cancelled_at)
                engine.observe("removal_seconds", waits[-1])
        del kept
        logging.info(
            f"Removed {len(stopped)} cancelled request(s) from the batch at step {engine.steps}"
            + (f", {max(waits) * 1000:.1f} ms after the disconnect" if waits else "")
        )

    @property
    def decoding(self) -> bool:
        """Whether a request of this batch is past its prompt."""
        return any(r["decoding"] for r in self.results.values())

    def _step(self) -> bool:
        engine = self.engine
        engine.steps += 1
        # (BatchGenerator reads it at each step, for the chunk it cuts next.)
        # A request whose prompt is in but its last token gets its first
        # token computed by the next step and returned by the one after,
        # each after that step's decode; a prompt chunk in either (of another
        # request) would come before it: those two steps cut none (0).
        # (Requests whose prompts were cached whole arm it as they come: at
        # most FIRST_TOKEN_STEPS such steps, then a chunk, so a stream of
        # them can't hold a long prompt back.)
        decode_only = self._decode_only > 0 and self._decode_only_run < FIRST_TOKEN_STEPS
        self._decode_only = max(0, self._decode_only - 1)
        self._decode_only_run = self._decode_only_run + 1 if decode_only else 0
        self.generator.prefill_step_size = 0 if decode_only else prefill_chunk(
            engine.cli_args.prefill_step_size, engine.decoding())
        tic = time.perf_counter()
        prompt_responses, gen_responses = self.generator.next()
        engine.thread_seconds["model"] += time.perf_counter() - tic
        if not prompt_responses and not gen_responses:
            return False
        engine.tokens_out += len(gen_responses)
        if prompt_responses or engine.steps % BUDGET_EVERY == 0:
            # Prefill allocates, and decode grows the caches a little per step.
            self.enforce_budget()

        for r in prompt_responses:
            if decode_only and not r.end_of_prompt:
                continue  # (no chunk: their progress is as it was)
            self._outbox.append((self.results[r.uid]["channel"], r.progress))
            if r.progress[1] - r.progress[0] == 1:
                self._decode_only = FIRST_TOKEN_STEPS

        if self.tapping:
            for uid, taken in self.generator.take_tapped().items():
                for position, cache in taken:
                    self._stored_checkpoint(uid, position, cache,
                                            self.results[uid]["taps"].pop(position))

        # Each request's checkpoints are its own segment ends: the cache
        # extracted there covers exactly the tokens that request has seen.
        ends = [
            r.uid
            for r in prompt_responses
            if r.end_of_segment
            and not r.end_of_prompt
            and self.results[r.uid]["segment_types"]
        ]
        for uid, (cache, tokens) in self.generator.extract_cache(ends).items():
            self._stored_checkpoint(uid, len(tokens), cache,
                                    self.results[uid]["segment_types"].pop())

        for r in gen_responses:
            result = self.results[r.uid]
            result["decoding"] = True
            detokenizer = result["detokenizer"]
            # The stop token itself is not decoded.
            if r.finish_reason != "stop":
                detokenizer.add_token(r.token)
            if r.finish_reason is not None:
                detokenizer.finalize()
            self._outbox.append((result["channel"],
                Response(
                    detokenizer.last_segment,
                    r.token,
                    _logprob(r.logprobs[r.token].item()) if result["logprobs"] else 0.0,
                    r.finish_reason,
                    _format_top_logprobs(r.logprobs, result["top_logprobs"], self.tokenizer),
                )
            ))
            if r.finish_reason is not None:
                # Stored before the answer ends, so that a follow-up sent the
                # moment it ends finds it.
                self._insert(self._key(r.uid, r.all_tokens), r.prompt_cache, "generated",
                             reply_start=self._reply_start(r.uid))
                constraint = result["constraint"]
                if constraint is not None and constraint.error is not None:
                    self._outbox.append((result["channel"], InternalError(
                        f"Structured output failed: {constraint.error}")))
                self._outbox.append((result["channel"], None))
                engine.log_store()
                del self.results[r.uid]
                self._unpark(r.uid)
        return True

    def _stored_checkpoint(self, uid, position: int, cache, kind: str):
        """Store request `uid`'s checkpoint at `position` (of its prompt; no
        cache: a tap that got none) and release the requests waiting for it."""
        result = self.results[uid]
        if cache is not None:
            self._insert(result["key_prefix"][:position], cache, kind)
        result["ends"] = [e for e in result["ends"] if e > position]
        self._unpark(uid, position)

    def _insert(self, key, cache, kind, reply_start=0):
        self.engine.store_entry(self.model_key, key, cache, kind, reply_start)

    def will_store(self, key, position: int) -> bool:
        """Whether a request of this batch is about to store a checkpoint at
        `key[:position]` (requests that arrive together with different last
        messages diverge from the store at the same point: one stores it)."""
        if not position:
            return False
        return any(position in r["ends"] and _same_prefix(key, r["key_prefix"], position)
                   for r in self.results.values())

    def park(self, request, planned: Planned, cached: int) -> bool:
        """Hold `request` back if a request in the batch is about to store a
        checkpoint that covers at least PARK_MIN_TOKENS more of its prompt
        than the store can (`cached`, at most): concurrent requests with the
        same new system prompt have it computed once, not once per request.
        Returns whether it was held; it comes back through take_unparked once
        that request stored the checkpoint or left, and is admitted again
        with its plan. A stream gets its headers and a keepalive meanwhile."""
        plan = planned.plan
        if plan.vision is not None or self.engine.store.disabled():
            return False  # (images: a plan of their own; no store: no checkpoint)
        key = plan.cache_key
        best = None
        for uid, r in self.results.items():
            for end in reversed(r["ends"]):
                if best is not None and end <= best[1]:
                    break
                if (cached + PARK_MIN_TOKENS <= end < len(key)
                        and _same_prefix(key, r["key_prefix"], end)):
                    best = (uid, end)
                    break
        if best is None:
            return False
        request[1].planned = planned
        self._parked.append([*best, request])
        request[0].put((0, len(plan.tokens)))
        request[0].set_aside_at = time.monotonic()  # (keepalives: Engine._tick)
        return True

    def _unpark(self, uid=None, stored: Optional[int] = None):
        """Release the requests waiting for `uid` (all with uid None): those
        whose checkpoint it stored (at `stored`), or all of them when it left."""
        keep = []
        for parked in self._parked:
            if uid is None or (parked[0] == uid and (stored is None or parked[1] <= stored)):
                self._unparked.append(parked[2])
            else:
                keep.append(parked)
        self._parked = keep

    def take_unparked(self) -> List[tuple]:
        """Requests whose wait is over, as they were queued."""
        out, self._unparked = self._unparked, []
        return out

    def held_back(self) -> List[tuple]:
        """Requests parked or released and not admitted yet."""
        return [p[2] for p in self._parked] + self._unparked

    def _reply_start(self, uid) -> int:
        """Where request `uid`'s generated tokens start in its cache key."""
        return len(self.results[uid]["key_prefix"])

    def _key(self, uid, tokens) -> List[int]:
        """The cache key of `tokens` of request `uid` (a prefix of its prompt
        and what it generated)."""
        prefix = self.results[uid]["key_prefix"]
        n = len(tokens)
        return prefix[:n] + list(tokens[len(prefix):n])

    def _fail_all(self, error: Exception):
        """A step raised: fail the requests in flight and start a fresh batch."""
        logging.exception(f"Batch step failed, failing {len(self.results)} requests")
        error = request_error(error, "generating")
        self.engine.reset_random_state()
        for result in self.results.values():
            result["channel"].put(error)
        self.results.clear()
        self._unpark()
        try:
            self.generator.close()
        except Exception:
            pass
        if isinstance(error, OutOfMemory):
            self.engine.relieve_memory()
        self._new_generator()

    def owned_nbytes(self) -> int:
        """Bytes of the caches this batch holds: those being prefilled and
        decoded, and those of queued requests whose images were prefilled at
        admission. Other requests still queued in the generator hold copies
        of stored entries, which share the store's buffers (MLX arrays are
        immutable, a fetch joins the tree's spans lazily), so counting them
        would count the same memory twice."""
        g = self.generator
        queued = sum(c.nbytes for p in g._unprocessed_sequences
                     if self.results.get(p[0], {}).get("prefilled") for c in p[3])
        return queued + sum(c.nbytes for c in g._prompt_batch.prompt_cache) + sum(
            c.nbytes for c in g._generation_batch.prompt_cache
        )

    def enforce_budget(self):
        """The prompt cache's byte budget covers the caches in flight too (as
        upstream's --prompt-cache-bytes does): the store gives way as they
        grow."""
        store = self.engine.store
        store.trim_to(store.max_bytes - self.engine.in_flight_nbytes())


# OpenAI's logprob for "very unlikely": what a token a constraint masked out
# (-inf, which JSON can't carry) is reported as.
UNLIKELY = -9999.0


def _logprob(value: float) -> float:
    return value if value > UNLIKELY else UNLIKELY


def _format_top_logprobs(logprobs, top_n, tokenizer):
    """Upstream's top-k entries, sorted by probability (most likely first)."""
    if top_n <= 0:  # (every token of most requests)
        return ()
    top = _upstream_top_logprobs(logprobs, top_n, tokenizer)
    for entry in top:
        entry["logprob"] = _logprob(entry["logprob"])
    return tuple(sorted(top, key=lambda t: -t["logprob"]))


def _same_prefix(a, b, n: int) -> bool:
    """Whether token lists `a` and `b` share their first `n` tokens (the
    last of them compared first: a cheap refusal)."""
    return a[n - 1] == b[n - 1] and a[:n] == b[:n]


def _drop_cached(segments, segment_types, n):
    """Remove the first `n` tokens (found in the cache) from the segments,
    and the boundaries that would end a segment shorter than
    MIN_SEGMENT_TOKENS (the segment joins the next one)."""
    segments, segment_types = list(segments), list(segment_types)
    while n > 0 and segments:
        if n >= len(segments[0]):
            n -= len(segments.pop(0))
            segment_types.pop(0)
        else:
            segments[0] = segments[0][n:]
            break
    # Each segment is a model call of its own: a checkpoint a token or two
    # after the previous one (in a multi-turn conversation, the divergence
    # point one token past the cached end of the last turn) costs more than
    # the tokens it saves.
    i = 0
    while i < len(segments) - 1:
        if len(segments[i]) < MIN_SEGMENT_TOKENS:
            segments[i : i + 2] = [segments[i] + segments[i + 1]]
            del segment_types[i]
        else:
            i += 1
    return segments, segment_types
