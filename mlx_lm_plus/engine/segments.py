"""Where a prompt is cut into model calls: the checkpoint segments of a plan
(with the divergence checkpoint found at admission), what the cache already
covers dropped, and how a runner turns them into its own calls."""

import itertools
from dataclasses import dataclass, replace
from typing import Dict, List, Tuple

from mlx_lm_plus.planning.prompt import PromptPlan, split_at

# A checkpoint is stored only this many tokens or more after the previous one
# (or the cached prefix): fewer are cheaper to recompute than a model call of
# their own. (16 cost the branch workload 11% more recomputation.)
MIN_SEGMENT_TOKENS = 4
# While requests decode, a prompt goes in chunks of --prefill-step-size over
# this (at least DECODING_CHUNK_MIN tokens). BatchGenerator runs one prompt
# chunk after each decode step, so a running stream waits a whole chunk
# between two tokens: a smaller chunk keeps it flowing while a long prompt is
# admitted, for a few more (and a little less efficient) model calls of that
# prompt. Alone, a prompt takes whole chunks.
DECODING_CHUNK_DIVISOR = 4
DECODING_CHUNK_MIN = 32


def prefill_chunk(step_size: int, decoding: bool) -> int:
    """Tokens per prompt chunk: --prefill-step-size, or a share of it while
    other requests decode (DECODING_CHUNK_DIVISOR)."""
    if not decoding:
        return step_size
    return min(step_size, max(DECODING_CHUNK_MIN, step_size // DECODING_CHUNK_DIVISOR))


def same_prefix(a, b, n: int) -> bool:
    """Whether token lists `a` and `b` share their first `n` tokens (the
    last of them compared first: a cheap refusal)."""
    return a[n - 1] == b[n - 1] and a[:n] == b[:n]


def drop_cached(segments, segment_types, n):
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


def with_divergence(plan: PromptPlan, depth: int):
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


@dataclass
class BatchSegments:
    """A request's prompt as the batch takes it: the segments the generator
    runs (`segments`, `segment_types`, the cached prefix left out), the
    positions of the checkpoints it will store (`ends`), and those taken
    inside a chunk by taps.py (`tapped`: position -> kind)."""

    segments: List[List[int]]
    segment_types: List[str]
    ends: List[int]
    tapped: Dict[int, str]


def for_batch(segments, segment_types, cached: int, keep_checkpoints: bool,
              tapping: bool) -> BatchSegments:
    """The segments of a request admitted into a batch, `cached` tokens of
    its prompt covered by its cache."""
    segments, segment_types = drop_cached(segments, segment_types, cached)
    if not keep_checkpoints:
        # Plain KV caches: any prefix of an entry serves by trimming, so
        # no checkpoints but the end of the system messages, where
        # concurrent requests that share them wait for this one (park).
        head = int(len(segments) > 1 and segment_types[0] == "system")
        segments = segments[:head] + [sum(segments[head:], [])]
        segment_types = segment_types[:head] + ["prompt"]
    # The positions of the checkpoints this request will store.
    ends = list(itertools.accumulate((len(s) for s in segments[:-1]), initial=cached))[1:]
    tapped = {}
    if tapping and len(segments) > 1:
        # One segment: the generator cuts its last token off, and that end
        # (the last checkpoint) stays a segment end; the checkpoints
        # before it are taken inside the chunks that pass them.
        checkpoints = list(zip(ends, segment_types))
        if len(segments[-1]) > 1:
            checkpoints.append((cached + sum(map(len, segments)) - 1, segment_types[-1]))
        segment_types = [checkpoints.pop()[1]]
        segments = [sum(segments, [])]
        tapped = dict(checkpoints)
    return BatchSegments(segments, segment_types, ends, tapped)


def for_sequential(segments, segment_types, cached: int) -> Tuple[List[List[int]], List[str]]:
    """The segments the sequential path prefills itself, a checkpoint stored
    at the end of each but the last, which stream_generate takes: the
    positions the batched path stores (the plan's segment ends, with the
    divergence checkpoint, and the end of the prompt but its last token)."""
    segments, kinds = drop_cached(segments, segment_types, cached)
    if len(segments[-1]) > 1:  # kinds already has one entry per end
        last = segments.pop()
        segments += [last[:-1], last[-1:]]
    return segments, kinds
