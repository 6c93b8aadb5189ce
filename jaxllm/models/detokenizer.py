"""Streaming detokenization and stop-string search.

Why: a server streams text as tokens arrive, but one token is not one character -- a byte-level
BPE token may hold half of a UTF-8 character, and sentencepiece-style decoders change a token's
text depending on what precedes it. Decoding a short sliding window of ids (vLLM's
prefix/read offsets) and emitting only text that can no longer change keeps per-step cost
constant and never leaks a U+FFFD for a character that is still being completed.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded along with the output, so the first token keeps its leading space


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    ``add(new_ids)`` returns the newly finalised text. Text ending in U+FFFD is held back until a
    later token completes the character; ``finish()`` releases whatever is still held (e.g. a
    truly invalid byte at the very end), so ``"".join(deltas) + finish()`` equals
    ``tokenizer.decode(output_ids)`` for byte-level tokenizers.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT:])
        # A prompt tail ending mid-character would make the first output token "repair" text that
        # was never emitted; in that case start the window at the first output token instead.
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []
        self.ids: list[int] = context
        self.prompt_context = len(context)
        self.prefix_offset = 0  # window start: text before it is final
        self.read_offset = len(context)  # text of ids[prefix_offset:read_offset] was already emitted
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.prompt_context:]

    def add(self, new_ids: list[int] | int) -> str:
        """Append output ids; return the text that became final (possibly "")."""
        if isinstance(new_ids, int):
            new_ids = [new_ids]
        if not new_ids:
            return ""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # Nothing new, or the tail is an incomplete character: wait for more ids.
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.output_text += delta
        return delta

    def finish(self) -> str:
        """Release text held back at the end of the sequence (invalid or unfinished bytes)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        delta = new_text[len(prefix_text):] if new_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.output_text += delta
        return delta


def find_stop(text: str, delta_len: int, stops: list[str], include_stop: bool) -> int | None:
    """Index to truncate ``text`` at if one of ``stops`` occurs in it, else None.

    Only the tail that could hold a match touching the newest ``delta_len`` characters is searched
    (earlier text was checked on previous steps). The earliest match wins; the cut falls after the
    stop string when ``include_stop`` and before it otherwise.
    """
    best: int | None = None
    best_end = 0
    for stop in stops:
        if not stop:
            continue
        start = max(0, len(text) - delta_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best):
            best, best_end = idx, idx + len(stop)
    if best is None:
        return None
    return best_end if include_stop else best
