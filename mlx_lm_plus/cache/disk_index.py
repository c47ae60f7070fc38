"""The disk tier's index in memory: its entries (DiskEntry) by name and in
a radix tree of their keys (radix.py's Nodes, as they are), with their
totals (the files' bytes, the tokens, the trimmable entries). DiskTier
(disk.py) is built on it: startup fills it from the SQLite index and the
writer adds what it writes, `find` walks it, and every use holds the
tier's lock.

Its own room: the tree's insert, split and prune (each tier keeps its own
tree: radix.py), apart from the files, threads and SQLite around it; it
knows nothing of them.
"""

from array import array
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from mlx_lm_plus.cache.radix import TOKENS, Node, descend, matching


@dataclass(eq=False)
class DiskEntry:
    """A stored entry; `find` hands it out as the handle for `load`."""
    name: str
    ntokens: int
    nbytes: int  # the file's size
    trimmable: bool
    kind: str
    last_used: float
    node: Any = field(default=None, repr=False)


class DiskIndex:
    """A disk tier's entries in memory (see the module doc). Callers hold
    the tier's lock, or own the tier alone."""

    def __init__(self):
        self._root = Node(None, array(TOKENS), 0)
        self._entries: Dict[str, DiskEntry] = {}
        self._bytes = 0
        self._tokens = 0
        self._trimmable = 0

    def _add(self, entry: DiskEntry, tokens: array):
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                child = node.children[tokens[pos]] = Node(node, tokens[pos:], len(tokens))
                node, pos = child, len(tokens)
                break
            m = matching(child.edge, tokens, pos)
            if m < len(child.edge):  # split the edge after m tokens
                upper = Node(node, child.edge[:m], node.depth + m)
                child.edge, child.parent = child.edge[m:], upper
                upper.children[child.edge[0]] = child
                node.children[upper.edge[0]] = upper
                child = upper
            node, pos = child, pos + m
        if node.entry is not None:
            self._remove(node.entry, prune=False)
        entry.node, node.entry = node, entry
        self._entries[entry.name] = entry
        self._bytes += entry.nbytes
        self._tokens += entry.ntokens
        self._trimmable += entry.trimmable

    def _remove(self, entry: DiskEntry, prune: bool = True):
        node, entry.node = entry.node, None
        node.entry = None
        del self._entries[entry.name]
        self._bytes -= entry.nbytes
        self._tokens -= entry.ntokens
        self._trimmable -= entry.trimmable
        if not prune:
            return
        while node.parent is not None and node.entry is None and not node.children:
            del node.parent.children[node.edge[0]]
            node.parent, node = None, node.parent
        if node.parent is not None and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()  # fold into its only child
            child.edge = node.edge + child.edge
            child.parent = node.parent
            node.parent.children[node.edge[0]] = child

    def _descend(self, key: array):
        """radix.descend from the index's root."""
        return descend(self._root, key)

    @staticmethod
    def _nearest_trimmable(node: Node) -> Optional[Node]:
        """The shallowest trimmable entry in `node`'s subtree."""
        best, stack = None, [node]
        while stack:
            n = stack.pop()
            if best is not None and n.depth >= best.depth:
                continue
            if n.entry is not None and n.entry.trimmable:
                best = n
                continue
            stack.extend(n.children.values())
        return best
