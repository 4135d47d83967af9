"""How a miss diagnosis (analysis/why.py) turns token ids into the text it shows: the model's tokenizer, or
the ids as numbers where the model has none."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Decoder:
    """How token ids become text for the windows shown (the model's tokenizer, or the ids as text)."""

    decode: Callable[[Sequence[int]], str]  # ids -> text, special tokens kept
    visible: Callable[[Sequence[int]], str]  # ids -> text without special tokens
    specials: Callable[[], frozenset[int]]  # the template's special tokens (asked only to show a divergence)

    @property
    def special_ids(self) -> frozenset[int]:
        return self.specials()

    @staticmethod
    def of(tokenizer: Any) -> Decoder:
        """The model's tokenizer as a decoder; without one, ids are shown as numbers."""
        if tokenizer is None:
            as_text = lambda ids: " ".join(map(str, ids))  # noqa: E731
            return Decoder(as_text, as_text, frozenset)
        special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        return Decoder(
            lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False),
            lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
            lambda: special_ids,
        )

    @staticmethod
    def deferred(load: Callable[[], Decoder]) -> Decoder:
        """A decoder that calls `load` (once) the first time it decodes: most causes decode nothing, and
        loading a tokenizer costs a command line more than the rest of its answer."""
        loaded = functools.cache(load)
        return Decoder(lambda ids: loaded().decode(ids), lambda ids: loaded().visible(ids),
                       lambda: loaded().special_ids)  # fmt: skip
