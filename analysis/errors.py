"""The analysis package's own error types (no torch: the CLI and the pages import and catch them).

A broken invariant raises `engine.core.errors.InvariantError`, the one type every `check_invariants` in the
project raises.
"""

from __future__ import annotations


class TraceError(ValueError):
    """A trace cannot be analysed: a malformed line, an empty trace, an unknown format, ...

    Attributes:
        reason: what is wrong, without the line number.
        line: the 1-based number of the offending line, or None when the error concerns the whole trace.
    """

    def __init__(self, reason: str, line: int | None = None) -> None:
        super().__init__(reason if line is None else f"line {line}: {reason}")
        self.reason = reason
        self.line = line


class NoVictimError(LookupError):
    """Raised by `KeyEvictionPolicy.victim` when no block is evictable. Callers check `can_evict()` first."""
