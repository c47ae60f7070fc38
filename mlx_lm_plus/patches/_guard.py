"""The version guard every patch goes through.

A patch replaces one upstream function with a fixed copy of mlx-lm 0.32.2's
body. It records the sha256 of that function's source (`inspect.getsource`)
as 0.32.2 ships it, and applies itself only while the function in place still
has that source: on any other mlx-lm the upstream code may have changed (or
been fixed), and our copy would silently undo that. Then it logs a warning
and leaves upstream's function alone.
"""

import hashlib
import inspect
import logging
from mlx_lm_plus.upstream import WRITTEN_FOR, mlx_lm_version

log = logging.getLogger("mlx_lm_plus.patches")


def source_sha256(fn) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


class Patch:
    """Replace `owner.attr` with `replacement`, if it is the function of `sha256`."""

    def __init__(self, name: str, owner, attr: str, sha256: str, replacement):
        self.name = name.rpartition(".")[2]  # the patch module's name
        self.owner, self.attr = owner, attr
        self.sha256 = sha256
        self.replacement = replacement
        # What `revert()` puts back: upstream's function (updated at apply).
        self.original = getattr(owner, attr)

    @property
    def target(self) -> str:
        return f"{self.owner.__module__}.{self.owner.__qualname__}.{self.attr}"

    @property
    def applied(self) -> bool:
        return getattr(self.owner, self.attr) is self.replacement

    def apply(self) -> bool:
        """Apply if the function in place is the one written for; idempotent."""
        if self.applied:
            return True
        current = getattr(self.owner, self.attr)
        try:
            found = source_sha256(current)
        except (OSError, TypeError):
            found = None  # no source to check: treat as different
        if found != self.sha256:
            log.warning(
                f"patch {self.name} not applied: {self.target} is not the function it was "
                f"written for (mlx-lm {WRITTEN_FOR}; installed mlx-lm {mlx_lm_version()}, "
                "source hash differs). Upstream's code stays in place."
            )
            return False
        self.original = current
        setattr(self.owner, self.attr, self.replacement)
        return True

    def revert(self):
        if self.applied:
            setattr(self.owner, self.attr, self.original)
