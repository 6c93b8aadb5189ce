"""The backend interface of constrained decoding: grammars compiled from a constraint, matchers
that follow the generated tokens and fill the packed token bitmask.

A backend (llguidance today; xgrammar or outlines could be added) turns one
``StructuredOutputsParams`` into a ``Grammar`` (compiled once, shared by every request with the
same constraint text) and a ``Grammar`` into per-request ``Matcher``s. The bitmask is numpy int32,
one bit per token id (bit ``i % 32`` of word ``i // 32``), 1 = allowed, llguidance's layout.
No JAX here: the scheduler hook and the host-side engine code use this module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from jaxllm.sampling_params import StructuredOutputsParams


class Matcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar forbids it (the matcher is then dead)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the grammar's start (as if no token was accepted)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when the grammar admits no further token (only end-of-sequence)."""

    @abstractmethod
    def is_accepting(self) -> bool:
        """True when the text so far is a complete match (end-of-sequence allowed)."""

    @abstractmethod
    def error(self) -> str:
        """The reason the matcher died, or '' while it is alive."""


class Grammar(ABC):
    """A compiled constraint; cheap to instantiate matchers from."""

    @abstractmethod
    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start."""


class Backend(ABC):
    """Compiles constraints for one tokenizer and fills bitmasks for a batch of matchers."""

    name: str = ""

    #: number of token ids the tokenizer knows; bitmask words past ``ceil(vocab_size / 32)``
    #: (the model's padding ids) are left 0, i.e. forbidden.
    vocab_size: int

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """Compile a constraint; ValueError with the compiler's reason if it is invalid."""

    @abstractmethod
    def fill_bitmask(self, matchers: list[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        """Write each matcher's allowed-next-token mask into ``bitmask[row]`` ([rows, words] int32)."""

    def bitmask_job(self, matchers: list[tuple[Matcher, int]], bitmask: np.ndarray) -> Callable[[], None]:
        """``fill_bitmask`` split in two: what needs Python now, and a thunk that computes the
        rows later (on the thread that waits for them), touching as little Python as it can."""
        return lambda: self.fill_bitmask(matchers, bitmask)
