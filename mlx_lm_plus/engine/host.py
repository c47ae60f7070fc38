"""What a runner (a model's `_Batch`, the `SequentialRunner`) uses of the
engine that owns it: a narrow, named interface, so a runner never reaches
into the engine's other parts and can be driven by a stand-in."""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Protocol

# Decode steps between two checks of the byte budget against the growing
# caches of a request (a KV buffer grows by 256 tokens at a time).
BUDGET_EVERY = 16


@dataclass
class Counters:
    """Where the generation thread's work goes (/v1/stats, the benchmarks)."""

    steps: int = 0  # generation steps run, for disconnect measurements
    admitted: int = 0  # requests admitted
    tokens_out: int = 0  # tokens generated
    # Prompt lookup (speculation.py), of finished rows: tokens proposed,
    # those the model kept, and the verifying steps they took.
    lookup_proposed: int = 0
    lookup_accepted: int = 0
    lookup_steps: int = 0
    # The same of a draft model's proposals (drafting.py).
    draft_proposed: int = 0
    draft_accepted: int = 0
    draft_steps: int = 0
    # Seconds: "model" in model steps (BatchGenerator.next, which samples
    # too), "admission" admitting requests (a plan made here when it could
    # not be made before, the store lookup, images through the vision
    # tower), "outside_model" the rest of each step (tokens to their
    # requests, stores at checkpoints and at a request's end).
    thread_seconds: Dict[str, float] = field(default_factory=lambda: {
        "model": 0.0, "admission": 0.0, "outside_model": 0.0})


class RunnerHost(Protocol):
    cli_args: Any
    store: Any  # cache.store.PromptStore
    group: Any  # distributed.Group
    planner: Any  # planner.Planner
    facts: Any  # facts.ModelFacts
    counters: Counters

    def beat(self, what: str, limit: Optional[tuple] = None) -> None:
        """The watchdog's: a unit of work starts."""

    def decoding(self) -> bool:
        """Whether a request of any model is past its prompt."""

    def stopping(self) -> bool:
        """Whether a stop cuts short the request served one at a time."""

    def tick(self) -> None:
        """What can't wait for the loop: finished loads, keepalives."""

    def observe(self, histogram: str, value: float) -> None: ...

    def share_object(self, obj, site: int) -> Any:
        """Rank 0's `obj` on every rank (distributed.Group.share_object)."""

    def log_store(self) -> None: ...

    def store_entry(self, model_key, key, cache, kind: str, reply_start: int = 0) -> None:
        """Store a request's cache; a failure loses only that entry."""

    def relieve_memory(self) -> None:
        """After an allocation failure: give memory back."""

    def reset_random_state(self) -> None: ...

    def in_flight_nbytes(self) -> int:
        """Bytes of the caches the batches hold."""

    def prefill_progress(self, channel, cache) -> Callable[[int, int], None]:
        """The callback run between prefill chunks (beat, cancel, budget)."""
