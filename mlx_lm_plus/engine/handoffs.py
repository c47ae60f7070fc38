"""What passes from planning to admission to a runner: a request's plan
(`Planned`, made off the generation thread), what a batch needs to take it
(`Admission`), and the states a request taken off the queue can be in."""

from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional

from mlx_lm_plus.planning.prompt import PromptPlan

# What a request taken off the queue waits for (Scheduler.readiness): nothing
# (READY); a model load on the loader thread (LOADING: later requests may go
# first); a model that must go idle to make room for its own (ROOM: later
# requests wait behind it, but for those of pinned models, so the running
# ones drain); or, served sequentially, the thread to itself (BLOCKED: every
# later request waits behind it).
READY, LOADING, ROOM, BLOCKED = "ready", "loading", "room", "blocked"
# What admission returns for a request _Batch.park held back.
PARKED = object()


@dataclass(eq=False, frozen=True)  # (identity: Planner.image_plans is a WeakSet of them)
class Planned:
    """A request planned off the generation thread (`Planner.plan`, run by the
    HTTP layer's planning thread): its prompt plan and its constraint's
    logits processor, for the model it was planned with. The generation
    thread uses it as it is when that model is the one it runs."""

    model_key: Any
    plan: PromptPlan
    constraint: Any = None  # a constraints.ConstraintProcessor, or None
    budget: Any = None  # a reasoning.ThinkingBudget, or None
    # The model has a disk tier: Planner.read_ahead may read its entry first.
    on_disk: bool = False


class Queued(NamedTuple):
    """A request as the HTTP side submits it: its channel, the validated
    request and its GenerationArguments, and its plan when one was made
    ahead (None: planned at admission). The plan travels here, beside the
    request, never written onto it."""

    channel: Any
    request: Any  # protocols.validation.Request
    args: Any  # mlx_lm.server.GenerationArguments
    planned: Optional[Planned] = None


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
