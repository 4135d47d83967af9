"""The engine's own error types, importable without torch (the console, storage and CLI catch them)."""

from __future__ import annotations


class InvariantError(RuntimeError):
    """A state invariant of the block pool, a KV cache manager, the coordinator or the engine is broken.

    Raised by every `check_invariants`; never an `AssertionError`, so `python -O` checks the same things.
    """


class NoFreeBlocksError(RuntimeError):
    """Raised by an allocation that the block pool cannot supply; nothing changed. Callers ask
    `can_allocate` first."""


class KVTierError(RuntimeError):
    """The disk tier's directory cannot serve this engine (engine/runner/kv_tier_files.py says why): refused
    at start, before the engine serves anything."""


def require(condition: bool, message: str) -> None:
    """Raise `InvariantError(message)` unless `condition` holds: an assert that `python -O` keeps."""
    if not condition:
        raise InvariantError(message)
