"""The engine: one generation thread that owns the models and their
BatchGenerators, and the facade the HTTP side calls.

Requests arrive through `Engine.submit` with a `channel` (anything with a
thread-safe `put`). The generation thread answers on that channel, in order:

    GenerationContext            the request was accepted (prompt size, cache hit)
    (processed, total) tuples    prefill progress
    Response ...                 one per generated token
    None                         done

or an Exception instead of any of these. This is the protocol of
mlx_lm.server 0.32.2's ResponseGenerator, so the pieces it hands around
(GenerationContext, Response, GenerationArguments) are reused as they are.

The loop, each turn: housekeeping (loads finished, idle models unloaded),
then the next request the scheduler gives it admitted (into its model's
batch, or served alone by the sequential path), else a step of every
active batch. Its parts, each in a module of its own:

    scheduler.py     which request comes next; requests set aside; hand-off
    residency.py     which models are loaded; loads, room, unloads, disk tiers
    planner.py       a request's plan (prompt, constraint, budget, context)
    handoffs.py      what passes from planning to admission to a runner
    admission.py     a request's admission: plan, cached prefix, images
    facts.py         per-model facts: checkpoints, batchable or not
    batch.py         a model's batch (BatchGenerator), stepped here
    sequential.py    the sequential path (draft model, seed with XTC, mlx-vlm's own)
    vision_prefill   images through the vision tower at admission
    segments.py      where a prompt is cut into model calls (checkpoints)
    outputs.py       the events a request's channel gets
    embedding.py     embedding and rerank requests: prefill-only batches
    distributed.py   mx.distributed: the group, its hand-offs, its errors
    watchdog.py      a step that never returns ends the process

and three parts of the Engine class itself, each a file of its own:
supervision.py (the loop restarted when it dies, the watchdog's shutdown),
housekeeping.py (between turns: loads, keepalives, idle models unloaded)
and figures.py (what the HTTP side reads: stats, models, memory).

Differences from upstream, each on purpose:
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
    unloaded (least recently used first) only when nothing runs on it.
"""

import gc
import logging
import os
import threading
import time
from concurrent.futures import Future
from threading import Thread
from typing import Any, Callable, Dict, Optional

import mlx.core as mx
from mlx_lm.server import TimeBudget

from mlx_lm_plus.cache.layers import cache_nbytes
from mlx_lm_plus.cache.store import PromptStore
from mlx_lm_plus.engine.admission import count, prepare
from mlx_lm_plus.engine.handoffs import PARKED, Planned, Queued
from mlx_lm_plus.engine.batch import _Batch
from mlx_lm_plus.engine.embedding import EmbeddingRunner
from mlx_lm_plus.engine.distributed import Group, ends_the_group
from mlx_lm_plus.engine.facts import ModelFacts
from mlx_lm_plus.engine.figures import EngineFigures
from mlx_lm_plus.engine.host import Counters
from mlx_lm_plus.engine.housekeeping import Housekeeping
from mlx_lm_plus.engine.planner import Planner
from mlx_lm_plus.engine.residency import ModelResidency
from mlx_lm_plus.engine.scheduler import Scheduler
from mlx_lm_plus.engine.segments import prefill_chunk
from mlx_lm_plus.engine.sequential import SequentialRunner
from mlx_lm_plus.engine.supervision import Supervision
from mlx_lm_plus.engine.watchdog import Watchdog
from mlx_lm_plus.errors import (
    Cancelled, EngineUnavailable, OutOfMemory, PromptError, RequestError, request_error,
)
from mlx_lm_plus.patches import apply_all as _apply_patches
from mlx_lm_plus.planning.embedding import EMBEDDING_REQUESTS, plan_embedding_request
from mlx_lm_plus.planning.vocab import check_vocab

class Engine(Supervision, EngineFigures, Housekeeping):
    def __init__(self, model_provider, store: PromptStore):
        self.model_provider = model_provider
        self.store = store
        args = model_provider.cli_args
        self.group = Group(store, on_clear=self._cleared, on_stop=self.stop)
        self.watchdog = Watchdog(on_hang=self._shut_down, stopped=lambda: self._stop)
        self.planner = Planner(model_provider, store, self.group)
        self.facts = ModelFacts(self.group, args)
        self.counters = Counters()
        self.residency = ModelResidency(
            model_provider, store, self.group, self.watchdog,
            fail_waiting=lambda key, error: self.scheduler.fail_waiting(key, error),
            in_use=self._in_use, on_unload=self._unloading)
        self.scheduler = Scheduler(
            model_provider, store, self.group, self.watchdog, self.residency,
            is_batchable=self.facts.is_batchable, any_active=self._any_active,
            decoding=self.decoding, stopping=lambda: self._stop, group_lost=self._group_lost)
        self.requests = self.scheduler.queue
        self.sequential = SequentialRunner(self)
        # /v1/embeddings and /v1/rerank: prefill-only batches (embedding.py),
        # of a prompt chunk's size (smaller while requests decode).
        self.embeddings = EmbeddingRunner(self._beat, budget=lambda: prefill_chunk(
            self.cli_args.prefill_step_size, self.decoding()))
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
        # set aside, in the scheduler; the one being served sequentially).
        self._batches: Dict[Any, _Batch] = {}
        self._housekept = 0.0  # when idle models were last looked at
        self._current = None
        self._current_key = None  # the model of the request served sequentially
        self._clear_buffers = False
        self.metrics = None  # a metrics.Metrics, set by the app
        self._thread = Thread(target=self._run, name="mlx_lm_plus-generation")
        self._thread.daemon = True
        self._admitting = None  # the channel of the request being admitted
        self._shutting_down = threading.Lock()
        # A stuck MLX call can't be interrupted, so a hang ends the process
        # (exit_process, replaced in tests) for a supervisor to restart.
        self.hung = False
        self.exit_process = os._exit

    # -- what the HTTP side and the tests read --

    @property
    def cli_args(self):
        return self.model_provider.cli_args

    @property
    def _is_distributed(self) -> bool:
        return self.group.is_distributed

    @_is_distributed.setter
    def _is_distributed(self, value: bool):
        # (The tests' harness runs the distributed paths on a group of one.)
        self.group.is_distributed = value

    @property
    def arrivals(self) -> Callable[[], int]:
        """How many requests the HTTP side has taken in and not submitted
        (set by the app; see Scheduler.await_arrivals)."""
        return self.scheduler.arrivals

    @arrivals.setter
    def arrivals(self, count: Callable[[], int]):
        self.scheduler.arrivals = count

    def start(self):
        # The upstream fixes in patches/, applied here rather than on import
        # (idempotent; each checks it matches the installed mlx-lm).
        _apply_patches()
        args = self.cli_args
        self.watchdog.step_timeout = args.step_timeout
        if self._is_distributed:
            self.watchdog.distributed_timeout = args.distributed_timeout
        self._thread.start()
        self.watchdog.start()

    def _beat(self, what: str, limit: Optional[tuple] = None):
        self.watchdog.beat(what, limit)

    beat = _beat

    def _idle(self):
        self.watchdog.idle()

    def relieve_memory(self):
        """After an allocation failure: give back half the prompt cache and
        MLX's buffer cache, so the next request has room."""
        self.store.trim_to(self.store.nbytes // 2, to_disk=False)
        for store in self._draft_stores():
            store.clear()
        gc.collect()
        mx.clear_cache()

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self.unhealthy_reason is None

    def submit(self, channel, request, args, planned: Optional[Planned] = None):
        """Queue a request (`planned`: its plan, made ahead by `plan`)."""
        if not self.is_healthy:
            raise self._unavailable()
        if self._stop:
            raise EngineUnavailable("server shutting down")
        self.requests.put(Queued(channel, request, args, planned))
        if self.hung:
            # The watchdog drained the queue before this put landed.
            self.scheduler.fail_queue(self._unavailable())
        elif self._stop:  # (the loop may have drained its queue before this put)
            self.scheduler.fail_queue(EngineUnavailable("server shutting down"))

    def _draft_stores(self):
        """The draft models' own prompt stores (drafting.DraftPrompts); any
        thread (a copy of the batches, each store behind its lock)."""
        return [b.draft_prompts.store for b in list(self._batches.values())
                if getattr(b, "draft_prompts", None) is not None]

    def clear_cache(self):
        """Drop every prompt cache entry; MLX's buffer cache follows on the
        generation thread. Returns the store's snapshot. Under mx.distributed
        every rank clears at the same hand-off (one store alone cleared would
        leave the others resuming prompts it recomputes)."""
        if not self._is_distributed:
            self.store.clear()
            for store in self._draft_stores():
                store.clear()
            self._clear_buffers = True
            return self.store.snapshot()
        if not self.is_healthy:
            raise self._unavailable()
        self.group.clear_everywhere(timeout=60)
        return self.store.snapshot()

    def _cleared(self):
        """The ranks cleared their stores together: MLX's buffer cache
        follows once nothing runs."""
        self._clear_buffers = True

    def observe(self, histogram: str, value: float):
        """A rare event for the metrics (a removal, a vision tower call)."""
        if self.metrics is not None:
            getattr(self.metrics, histogram).observe(value)

    def stop(self):
        """Stop the generation loop: every request it holds is answered
        ("server shutting down"), the prompt cache saved to disk (if any)."""
        self._stop = True

    def stop_and_join(self, timeout=None):
        self._stop = True
        self._thread.join(timeout)
        self.residency.close()

    def join(self):
        self._thread.join()

    def share_object(self, obj, site: int):
        """Rank 0's `obj` on every rank (Group.share_object)."""
        return self.group.share_object(obj, site, self._stop)

    # -- planning, on the HTTP side's threads --

    def plan(self, request, args) -> Optional[Planned]:
        """Planner.plan: a request planned for the model it names, on the
        caller's thread (None: planned at admission)."""
        return self.planner.plan(request, args)

    def plan_embedding(self, request, args):
        """An /v1/embeddings or /v1/rerank request planned for the model it
        names, on the caller's thread (None: planned at admission, its
        model not loaded yet). Raises PromptError."""
        lm = self.model_provider.get(self.model_provider.key_for(args.model))
        return None if lm is None else plan_embedding_request(lm, request)

    def read_ahead(self, planned: Planned) -> Optional[Future]:
        return self.planner.read_ahead(planned)

    def count_prompt(self, request, args) -> Optional[int]:
        return self.planner.count_prompt(request, args)

    # -- what the runners use (host.RunnerHost) --

    def prefill_progress(self, channel, cache):
        """The callback run between prefill chunks on this thread: a beat for
        the watchdog, a stop for a client that went away, a keepalive, and the
        byte budget against the request's growing cache."""
        def progress(done, total):
            self._beat("a prefill chunk")
            if self.group.gone(channel):
                raise Cancelled(done)
            if self.stopping():
                raise EngineUnavailable("server shutting down")
            channel.put((done, total))
            self.tick()
            self.store.trim_to(self.store.max_bytes - cache_nbytes(cache))

        return progress

    def _save_to_disk(self):
        """At shutdown, on this thread (the entries' arrays are its own):
        memory entries to the disk tiers, within --shutdown-timeout."""
        self.residency.save_to_disk()

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

    def decoding(self) -> bool:
        """Whether a request of any model is past its prompt (a prompt chunk
        of one model's batch stalls the streams of the others too)."""
        return any(b.decoding for b in self._batches.values())

    def stopping(self) -> bool:
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

    # -- the generation loop --

    def _generate(self):
        # All generation runs on this thread's stream, the same one the
        # distributed synchronisation uses.
        stream = mx.default_stream(mx.default_device())
        self.residency.load_default()
        self._batches, self.scheduler.pending = {}, []

        if self._is_distributed:
            self._beat("agreeing with the other ranks at the start")
            self.group.agree_on_random_state()
            self.group.agree_on_the_store()

        # (Under mx.distributed the ranks stop together, at the hand-off
        # that tells them rank 0 stops.)
        while not (self.group.stopped if self._is_distributed else self._stop):
            self._housekeeping()
            request = self.scheduler.next()
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
            if self.scheduler.await_arrivals():
                continue
            self._step_batches()

        self._fail_held(EngineUnavailable("server shutting down"))
        self.scheduler.fail_queue(EngineUnavailable("server shutting down"))
        self.residency.fail_loading(EngineUnavailable("server shutting down"))
        self.group.fail_clear(EngineUnavailable("server shutting down"))
        self._save_to_disk()
        self.scheduler.fail_queue(EngineUnavailable("server shutting down"))  # (came meanwhile)
        self.model_provider.reset()
        gc.collect()

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
            self.scheduler.pending[:0] = batch.take_unparked()
        if self.embeddings.active:
            try:
                self.embeddings.step()  # (it answers its own passes' failures)
            except Exception as e:  # (a bug: its jobs fail, not the loop)
                logging.exception("The embedding runner failed")
                self.embeddings.fail(request_error(e, "running the embedding model"))

    def _admit(self, request, stream):
        """Admit a request whose model is loaded: into that model's batch
        (started if it has none), or the sequential path."""
        channel, req, args, planned = request
        if self.group.gone(channel):
            channel.removed()
            return
        lm = self.model_provider.get(self.model_provider.key_for(args.model))
        lm.last_used = time.monotonic()
        if getattr(req, "keep_alive", None) is not None:
            lm.keep_alive = req.keep_alive
        if isinstance(req, EMBEDDING_REQUESTS) or lm.embedder is not None:
            if self.embeddings.admit(channel, lm, req, planned):
                self.counters.admitted += 1
                if self.scheduler.wave_since is None and not self.decoding():
                    # (requests sent together share it)
                    self.scheduler.wave_since = time.monotonic()
            return
        if getattr(req, "count_only", False):
            count(self, lm, channel, req, args)
            return
        if lm.vocab_size is not None:  # (checked by the API when it was loaded)
            try:
                check_vocab(args.sampling.top_k, args.logits.logit_bias, lm.vocab_size)
            except RequestError as e:
                channel.put(PromptError(str(e)))
                return
        if not self.facts.is_batchable(lm, req, args):
            self._current, self._current_key = channel, lm.key
            try:
                self.sequential.serve(lm, channel, req, args, planned, stream)
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

        admission = prepare(
            self, lm, channel, req, args, planned, batch=(batch, request),
            between_chunks=None if self._is_distributed else between_chunks)
        if admission is not PARKED:
            if admission is not None:
                batch.insert(admission)
                if self.scheduler.wave_since is None and not self.decoding():
                    self.scheduler.wave_since = time.monotonic()
            self.counters.admitted += 1
        self.counters.thread_seconds["admission"] += time.perf_counter() - tic - stepped

    def _forget(self, channel):
        """Drop every reference the generation thread holds to `channel`."""
        self.scheduler.pending = [r for r in self.scheduler.pending if r[0] is not channel]
        if self._current is channel:
            self._current = None
