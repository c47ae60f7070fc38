"""Which models are in memory: loading one on the loader thread while the
others keep generating (one at a time; under mx.distributed on the
generation thread, every rank at the same step), making room for it by
unloading idle models least recently used first, unloading models past
their TTL or keep_alive, and each loaded model's disk tier."""

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx

from mlx_lm_plus.engine.handoffs import LOADING, READY, ROOM
from mlx_lm_plus.engine.distributed import GroupDiverged
from mlx_lm_plus.errors import ModelLoadError
from mlx_lm_plus.models.cpu import weights_identity
from mlx_lm_plus.models.provider import serves_images, vision_of


class ModelResidency:
    """The provider's loaded models, for the generation thread.

    `fail_waiting(key, error)` answers the requests set aside for model
    `key` (its load failed); `in_use(key)` says whether a model has requests
    running or held; `on_unload(key)` lets go of what the engine keeps for a
    model (its batch)."""

    def __init__(self, provider, store, group, watchdog,
                 fail_waiting: Callable, in_use: Callable, on_unload: Callable):
        self.provider = provider
        self.store = store
        self.group = group
        self.watchdog = watchdog
        self.fail_waiting = fail_waiting
        self.in_use = in_use
        self.on_unload = on_unload
        # Models load here, one at a time, while the generation thread goes
        # on with the others: (key, Future, when it started) of the load
        # running, or None.
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="mlx_lm_plus-loader")
        self.loading: Optional[tuple] = None
        self._started = False  # the default model is loaded at the first start only
        self.unloaded = False  # a model was unloaded: clear MLX's buffer cache when idle

    @property
    def cli_args(self):
        return self.provider.cli_args

    def readiness(self, channel, key):
        """For a request (its `channel`) whose model `key` is not loaded:
        LOADING while another model loads or once its own load started,
        ROOM while it waits for a model to go idle, or the error it gets."""
        if self.loading is not None:
            return LOADING
        if self.group.is_distributed:
            # (A Hugging Face repo's small files may be fetched: a load's limit.)
            self.watchdog.beat("looking for a model on every rank", self.load_limit())
            unloadable = self.group.loadable(channel, key, self.cli_args.pipeline)
            if unloadable is not None:
                return unloadable  # (before the model loaded makes room for it)
        room = self.make_room(key)
        return self.start_load(key) if room is READY else room

    def make_room(self, key):
        """READY when model `key` may be loaded now (idle models unloaded for
        it, least recently used first), ROOM while it must wait for a model
        to go idle, or the error its requests get when it never can (the
        models loaded are all pinned and fill --max-loaded-models)."""
        provider = self.provider
        extra = self.store.max_bytes or 0
        while not provider.fits(key, extra):
            idle = sorted((lm for lm in provider.loaded.values()
                           if not lm.pinned and not self.in_use(lm.key)),
                          key=lambda lm: lm.last_used)
            if idle:
                self.unload(idle[0].key, "to make room for " + key[0])
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

    def start_load(self, key):
        """Load `key`: on the loader thread (LOADING), or here under
        mx.distributed, where every rank must have it at the same step."""
        if self.group.is_distributed:
            # (A load that fails on one rank leaves the others in its
            # collectives: the group ends. _unloadable came first.)
            self.watchdog.beat("loading a model", self.load_limit())
            try:
                lm = self.provider.load(key)
            except Exception as e:
                raise GroupDiverged(f"loading {key[0]} failed on rank {self.group.rank}: "
                                    f"{e!r}") from e
            self.loaded(lm)
            return READY
        logging.info(f"Loading model {key[0]} (requests for it wait; others go on)")
        self.loading = (key, self._loader.submit(self.provider.load, key),
                         time.monotonic())
        return LOADING

    def load_limit(self) -> tuple:
        """How long a load under mx.distributed may take (a rank lost during
        it leaves the others in its collectives)."""
        limit = self.cli_args.model_load_timeout
        return (limit, "--model-load-timeout") if limit else (math.inf, "")

    def loaded(self, lm):
        self.provider.add(lm)
        self.attach_disk(lm)

    def load_default(self):
        """The default model, loaded on this thread at the start (as upstream;
        not again after a restart of the loop: it may have been unloaded,
        and another model may be loading)."""
        key = self.provider.default_key
        if not self._started and key is not None and self.provider.get(key) is None:
            if self.group.is_distributed:  # (a lost rank stalls a load: watched)
                self.watchdog.beat("loading the model", self.load_limit())
            else:
                self.watchdog.idle()
            try:
                self.loaded(self.provider.load(key))
            except Exception:
                if self.cli_args.model is not None or self.group.is_distributed:
                    raise  # (--model: as upstream, the server has no model)
                # The first of --models-dir's folders or --models-config's
                # entries: the others still serve, and this one's requests
                # get its load error when they ask for it, as any other's.
                logging.exception(f"Loading {key[0]} at the start failed; serving the "
                                  "other models")
                self.provider.forget_size(key)
        self._started = True

    def fail_loading(self, error):
        if self.loading is not None:
            self.loading[1].cancel()
            self.fail_waiting(self.loading[0], error)
            self.loading = None

    def poll_load(self):
        """A finished load: its model in service; an overdue one
        (--model-load-timeout): given up, its requests answered."""
        loading = self.loading
        if loading is not None and loading[1].done():
            (key, future, _), self.loading = loading, None
            try:
                self.loaded(future.result())
            except Exception as e:
                logging.exception(f"Loading {key[0]} failed")
                self.provider.forget_size(key)
                self.fail_waiting(key, ModelLoadError(str(e)))
        now = time.monotonic()
        limit = self.cli_args.model_load_timeout
        if loading is not None and self.loading is loading and limit and \
                now - loading[2] > limit:
            # A stalled disk or download: its requests are answered, and the
            # next load gets a new loader thread (this one is left to end,
            # its model dropped).
            key = loading[0]
            logging.error(f"Loading {key[0]} has taken more than {limit:g} s "
                          "(--model-load-timeout): given up")
            self.loading = None
            self._loader.shutdown(wait=False)
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="mlx_lm_plus-loader")
            self.provider.forget_size(key)
            self.fail_waiting(key, ModelLoadError(
                f"Loading {key[0]} took more than {limit:g} s (--model-load-timeout)"))

    def unload_idle(self, busy: set):
        """Unload the idle models past their TTL (--model-ttl) or keep_alive;
        `busy`: the keys of models with work running or waiting (their idle
        time starts again). Not under mx.distributed, whose ranks' clocks
        differ: their models must not."""
        if self.group.is_distributed:
            return
        now = time.monotonic()
        ttl = self.cli_args.model_ttl
        for lm in list(self.provider.loaded.values()):
            if lm.key in busy:
                lm.last_used = now
                continue
            limit = lm.idle_limit(ttl)
            if limit is not None and now - lm.last_used >= limit:
                self.unload(lm.key, f"idle for {now - lm.last_used:.0f} s")

    def unload(self, key, why: str):
        self.on_unload(key)
        self.provider.unload(key, why)
        # Its weights go with the last reference; MLX's buffer cache is
        # cleared once nothing runs or waits.
        self.unloaded = True

    def attach_disk(self, lm):
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
        if (not args.prompt_cache_dir
                or self.group.is_distributed or self.store.disk_for(key) is not None):
            return
        from mlx_lm_plus.cache.disk import DiskTier
        from mlx_lm_plus.cache.disk_format import model_identity

        model, adapter, draft = key
        extra = f"bits={self.store.bits},group={self.store.group_size}"
        extra += weights_identity(getattr(lm, "weights_float32", False),
                                  getattr(lm, "native_kernels", False))
        if args.kv_bits is not None:
            extra += (f",kv_bits={args.kv_bits},kv_group={args.kv_group_size},"
                      f"kv_start={args.quantized_kv_start}")
        if draft is not None:
            extra += f",draft={model_identity(draft)}"
            if vision_of(lm) is not None:
                # (A batched vision family with a draft loads as a vision
                # model now, its caches M-RoPE's; it loaded as text before.)
                extra += ",vision"
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

    def save_to_disk(self):
        """At shutdown, on this thread (the entries' arrays are its own):
        memory entries to the disk tiers, within --shutdown-timeout."""
        if self.cli_args.prompt_cache_dir:
            self.store.save_to_disk(self.cli_args.shutdown_timeout)

    def describe(self, active: Callable[[Any], int]) -> List[Dict[str, Any]]:
        """The served set, then models loaded on request, each with whether it
        is loaded and what it holds (`active(key)`: the requests running on
        a model). Safe from any thread."""
        provider = self.provider
        now = time.monotonic()
        loaded = dict(provider.loaded)
        served = {e.key for e in provider.served}
        loading = self.loading  # (read once: this thread may clear it meanwhile)
        loading = loading[0] if loading is not None else None
        out = []
        # One row per served entry (presets of one folder share its state),
        # then the models loaded on request.
        for entry, key in ([(e, e.key) for e in provider.served]
                           + [(None, k) for k in loaded if k not in served]):
            lm = loaded.get(key)
            running = active(key)
            out.append({
                "id": entry.name if entry is not None else key[0],
                "path": key[0],
                "loaded": lm is not None,
                "loading": key == loading,
                "pinned": lm.pinned if lm is not None else any(
                    e.pinned for e in provider.served if e.key == key),
                "weights_bytes": lm.nbytes if lm is not None else 0,
                "load_seconds": round(lm.load_seconds, 2) if lm is not None else None,
                "active_requests": running,
                "idle_seconds": (0.0 if running else round(now - lm.last_used, 1))
                if lm is not None else None,
                "keep_alive": lm.keep_alive if lm is not None else None,
                # "generate", "embed" (/v1/embeddings) or "rerank" (/v1/rerank)
                "task": lm.task if lm is not None else provider.task(key),
            })
        return out

    def vision_stats(self) -> Optional[Dict[str, int]]:
        """Images through the vision tower and images served from the cache,
        over the loaded vision models (None when none is loaded)."""
        visions = [lm.processor for lm in list(self.provider.loaded.values())
                   if serves_images(lm)]
        if not visions:
            return None
        return {"images_encoded": sum(v.calls for v in visions),
                "images_from_cache": sum(v.hits for v in visions)}

    def serves_vision(self, model) -> bool:
        """Whether image requests for `model` (a ModelDescription) are
        planned by vision.py (mlx-vlm models)."""
        key = self.provider.key_for(model)
        lm = self.provider.get(key)
        if lm is not None:
            return serves_images(lm)
        return self.provider.is_vision(key)

    def image_max_pixels(self, model) -> Optional[int]:
        """The most pixels `model`'s image processor keeps (it scales larger
        images down), or None."""
        key = self.provider.key_for(model)
        lm = self.provider.get(key)
        if lm is not None and (vision := vision_of(lm)) is not None:
            return vision.max_pixels
        return self.provider.image_max_pixels(key)

    def close(self):
        self._loader.shutdown(wait=False, cancel_futures=True)
