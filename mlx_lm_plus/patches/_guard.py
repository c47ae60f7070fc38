"""The version guard every patch goes through.

A patch replaces one upstream function with a fixed copy of mlx-lm 0.32.2's
body (or of another package's, at the version it names: mlx-embeddings
0.1.0's). It records the sha256 of that function's source
(`inspect.getsource`) as that version ships it, and applies itself only while
the function in place still has that source: on any other version the
upstream code may have changed (or been fixed), and our copy would silently
undo that. Then it logs a warning and leaves upstream's function alone.
"""

import hashlib
import inspect
import logging

from mlx_lm_plus.upstream import WRITTEN_FOR, package_version

log = logging.getLogger("mlx_lm_plus.patches")


def source_sha256(fn) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


class Patch:
    """Replace `owner.attr` with `replacement`, if it is the function of `sha256`."""

    def __init__(self, name: str, owner, attr: str, sha256: str, replacement,
                 package: str = "mlx-lm", written_for: str = WRITTEN_FOR, depends_on=()):
        self.name = name.rpartition(".")[2]  # the patch module's name
        self.package, self.written_for = package, written_for  # whose function, which version
        self.owner, self.attr = owner, attr
        self.sha256 = sha256
        self.replacement = replacement
        # Other upstream functions the fix is right only with, as
        # (owner, attr, sha256): a patch of one function whose meaning rests
        # on how another uses its result (a mask, say) must not apply
        # where that other one changed while it did not.
        self.depends_on = tuple(depends_on)
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
        checked = [(self.target, current, self.sha256)] + [
            (f"{owner.__module__}.{owner.__qualname__}.{attr}", getattr(owner, attr, None), sha)
            for owner, attr, sha in self.depends_on]
        for target, fn, sha256 in checked:
            try:
                found = source_sha256(fn)
            except (OSError, TypeError):
                found = None  # no source to check: treat as different
            if found != sha256:
                log.warning(
                    f"patch {self.name} not applied: {target} is not the function it was "
                    f"written for ({self.package} {self.written_for}; installed "
                    f"{self.package} {package_version(self.package)}, source hash differs). "
                    "Upstream's code stays in place."
                )
                return False
        self.original = current
        setattr(self.owner, self.attr, self.replacement)
        return True

    def revert(self):
        if self.applied:
            setattr(self.owner, self.attr, self.original)
