"""Constrained decoding (structured outputs): JSON schema, regex, choice, grammar, structural tags.

``validate(params, tokenizer)`` is the server's up-front check: it compiles the constraint (with a
size and time limit) and raises ValueError with the compiler's reason, so a bad schema is a 400
and never a failed stream; the compiled grammar stays cached for the request that follows.
Backends live behind ``backend.Backend`` (llguidance today). No JAX in this package.
"""

from __future__ import annotations

import threading
import weakref

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured.backend import Backend, Grammar, Matcher
from jaxllm.structured.compiler import COMPILE_TIMEOUT_S, GrammarCompiler

__all__ = ["Backend", "Grammar", "Matcher", "GrammarCompiler", "built_compiler", "compiler_for", "register_eos",
           "validate", "COMPILE_TIMEOUT_S"]

_compilers: "weakref.WeakKeyDictionary[object, GrammarCompiler]" = weakref.WeakKeyDictionary()
_eos_of: "weakref.WeakKeyDictionary[object, tuple[int, ...]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def register_eos(tokenizer, eos_ids: tuple[int, ...]) -> None:
    """Tell compilers built later for ``tokenizer`` which ids end a sequence (the model's EOS
    set, which may be wider than the tokenizer's); the engine calls this at start-up (cheap)."""
    with _lock:
        _eos_of[tokenizer] = tuple(eos_ids)


def built_compiler(tokenizer) -> GrammarCompiler | None:
    """The compiler of ``tokenizer`` if it was built already (never builds one)."""
    with _lock:
        return _compilers.get(tokenizer)


def compiler_for(tokenizer, backend: str = "guidance") -> GrammarCompiler:
    """The shared compiler (and cache) of one tokenizer object; built on first use (~0.5 s)."""
    with _lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None:
            if backend not in ("guidance", "auto"):
                raise ValueError(f"structured_outputs backend must be 'guidance', got {backend!r}")
            from jaxllm.structured.llguidance_backend import LLGuidanceBackend

            compiler = GrammarCompiler(LLGuidanceBackend.for_tokenizer(tokenizer, _eos_of.get(tokenizer, ())))
            _compilers[tokenizer] = compiler
        return compiler


def validate(params: StructuredOutputsParams, tokenizer, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
    """Compile ``params`` for ``tokenizer``; ValueError with the reason if invalid, too big or too slow."""
    if not isinstance(params, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(params).__name__}")
    compiler_for(tokenizer).compile_now(params, timeout_s)
