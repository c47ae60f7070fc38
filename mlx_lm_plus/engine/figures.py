"""What the HTTP side reads of the engine, a part of `Engine` (engine.py):
the figures of /v1/stats, /metrics and the dashboard, the served and loaded
models of /v1/models, and what a model takes of images. Each is safe to
read from any thread: it copies what the generation thread may change
under it, or asks a part that is.
"""

from typing import Any, Dict, List, Optional

import mlx.core as mx


class EngineFigures:
    """(A part of `Engine`: it reads its counters, planner, residency,
    batches, embedding runner and store.)"""

    @property
    def steps(self) -> int:
        return self.counters.steps

    @property
    def admitted(self) -> int:
        return self.counters.admitted

    @property
    def tokens_out(self) -> int:
        return self.counters.tokens_out

    @property
    def prompt_lookup(self) -> Dict[str, int]:
        """Prompt lookup's figures over finished requests (speculation.py)."""
        c = self.counters
        return {"proposed_tokens": c.lookup_proposed, "accepted_tokens": c.lookup_accepted,
                "verify_steps": c.lookup_steps}

    @property
    def draft_model(self) -> Dict[str, int]:
        """A draft model's figures over finished requests (drafting.py), and
        the bytes of the drafts' own prompt stores now."""
        c = self.counters
        return {"proposed_tokens": c.draft_proposed, "accepted_tokens": c.draft_accepted,
                "verify_steps": c.draft_steps,
                "cache_bytes": sum(store.nbytes for store in self._draft_stores())}

    @property
    def embedding_stats(self) -> Dict[str, int]:
        return {"batches": self.embeddings.batches, "inputs": self.embeddings.inputs}

    @property
    def thread_seconds(self) -> Dict[str, float]:
        return self.counters.thread_seconds

    @property
    def planned_at_admission(self) -> int:
        return self.planner.planned_at_admission

    def cache_snapshot(self) -> Dict[str, Any]:
        """The prompt cache's figures (safe from any thread)."""
        return self.store.snapshot()

    def vision_stats(self) -> Optional[Dict[str, int]]:
        return self.residency.vision_stats()

    def models(self) -> List[Dict[str, Any]]:
        """ModelResidency.describe: the served and loaded models (safe from
        any thread: /v1/models, /metrics, the dashboard)."""
        batches = dict(self._batches)
        current = self._current_key
        return self.residency.describe(
            lambda key: (len(batches[key].results) if key in batches else 0) + (current == key)
            + self.embeddings.held_for(key))

    def serves_vision(self, model) -> bool:
        return self.residency.serves_vision(model)

    def image_max_pixels(self, model) -> Optional[int]:
        return self.residency.image_max_pixels(model)

    @staticmethod
    def memory() -> Dict[str, int]:
        """MLX's allocator figures, in bytes (safe from any thread)."""
        return {
            "mlx_active_bytes": mx.get_active_memory(),
            "mlx_cache_bytes": mx.get_cache_memory(),
            "mlx_peak_bytes": mx.get_peak_memory(),
        }

    def in_flight_nbytes(self) -> int:
        """Bytes of the caches the batches hold (see _Batch.owned_nbytes)."""
        return sum(b.owned_nbytes() for b in self._batches.values())

    @property
    def active_requests(self) -> int:
        """Requests the generation thread holds (in the batch, sequential or
        embedding)."""
        n = sum(len(b.results) for b in list(self._batches.values()))
        return n + (self._current is not None) + len(self.embeddings.jobs)
