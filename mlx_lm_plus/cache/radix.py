"""The token trie both prompt cache tiers index their entries by: a radix
tree (compressed: each node's edge holds a run of token ids, and a node
exists only where an entry ends or keys diverge) of token arrays.

PromptStore (store.py) and DiskTier (disk.py) each keep one tree per model.
What is common lives here: the token array type (TOKENS), the node's links
(Node: parent, edge, depth, children, entry) and the lookups (`descend`,
`matching`). The memory tier's nodes carry more (the edge's KV and the
count of entries below: store._Node, a subclass of Node); the disk tier's
are Nodes as they are. Each tier inserts, splits and prunes its own tree,
as its bookkeeping differs (the store cuts KV spans and counts bytes on
every change; the disk tier counts files).
"""

from array import array
from typing import Any, Dict, Optional

# Edges hold token ids as int64: image ids are negative 63-bit fingerprints.
TOKENS = "q"
TOKEN_BYTES = array(TOKENS).itemsize


class Node:
    """A node of a tier's tree; `entry` is the tier's entry ending here
    (PromptStore's Entry, DiskTier's DiskEntry), or None."""

    __slots__ = ("parent", "edge", "depth", "children", "entry")

    def __init__(self, parent: Optional["Node"], edge: array, depth: int):
        self.parent = parent
        self.edge = edge  # the tokens from the parent to here (root: none)
        self.depth = depth  # tokens from the root to the end of the edge
        # Keyed by the first token of the child's edge.
        self.children: Dict[int, "Node"] = {}
        self.entry: Optional[Any] = None


def matching(edge: array, key: array, pos: int) -> int:
    """How many leading tokens of `edge` equal key[pos:]."""
    n = min(len(edge), len(key) - pos)
    if (edge if n == len(edge) else edge[:n]) == key[pos:pos + n]:
        return n
    lo, hi = 0, n  # edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        m = (lo + hi) // 2
        if edge[lo:m] == key[pos + lo:pos + m]:
            lo = m
        else:
            hi = m
    return lo


def descend(node, key: array):
    """Follow `key` down from `node` (a radix tree of nodes with `children`
    keyed by first token, `edge` and `entry`; also the disk tier's index):
    (the deepest node whose whole edge it matches, the tokens matched, the
    nodes with entries on the way, the child whose edge it leaves part way
    or None)."""
    pos, on_path = 0, []
    while pos < len(key):
        child = node.children.get(key[pos])
        if child is None:
            break
        m = matching(child.edge, key, pos)
        pos += m
        if m < len(child.edge):
            return node, pos, on_path, child
        node = child
        if node.entry is not None:
            on_path.append(node)
    return node, pos, on_path, None
