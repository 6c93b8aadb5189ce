"""Grammar compilation off the step loop: a thread pool and a cache keyed by the constraint text.

``submit`` never blocks: it returns a future (a finished one on a cache hit). The scheduler keeps
a request in the waiting queue until its future is done (``ready``), so a slow compile never
stalls the running batch. ``compile_now`` waits, with a time limit, for callers that must answer
at once (the server's up-front validation, which turns a bad grammar into a 400).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured.backend import Backend, Grammar

# A grammar that takes longer than this to compile is refused (ValueError -> 400).
COMPILE_TIMEOUT_S = 10.0
CACHE_SIZE = 256
# A constraint's text (schema, regex, grammar, choices) longer than this is refused up front.
MAX_CONSTRAINT_CHARS = 256_000
# llguidance recurses over nested rules while building a grammar: a few thousand nested rules
# overflow a default 8 MiB thread stack (a segfault, not an exception), so compile threads get
# a large stack (virtual; only touched pages are used).
COMPILE_STACK_BYTES = 512 << 20


def _constraint_chars(params: StructuredOutputsParams) -> int:
    return sum(len(str(part)) for part in params.key() if part is not None)


class GrammarCompiler:
    """Compiles constraints on ``num_threads`` worker threads, caching the results (LRU)."""

    def __init__(self, backend: Backend, num_threads: int = 2, cache_size: int = CACHE_SIZE):
        self.backend = backend
        self.cache_size = cache_size
        self.num_compiles = 0  # successful compiles (cache hits not counted)
        self.compile_seconds = 0.0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            self._threads = [threading.Thread(target=self._work, name=f"grammar-{i}", daemon=True)
                             for i in range(num_threads)]
            for t in self._threads:
                t.start()
        finally:
            threading.stack_size(old)
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compile of ``params`` (already done, running, or queued now)."""
        key = params.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = Future()
            if _constraint_chars(params) > MAX_CONSTRAINT_CHARS:
                fut.set_exception(ValueError(f"structured_outputs.{params.kind} is longer than the "
                                             f"{MAX_CONSTRAINT_CHARS} character limit"))
                return fut
            self._jobs.put((fut, params))
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f, k=key: self._forget_failed(k, f))
        return fut

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, params = job
            if not fut.set_running_or_notify_cancel():
                continue
            t0 = time.perf_counter()
            try:
                grammar = self.backend.compile(params)
                self.compile_seconds += time.perf_counter() - t0
                self.num_compiles += 1
                fut.set_result(grammar)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(exc)

    def _forget_failed(self, key: tuple, fut: Future) -> None:
        """Failed compiles are not cached (the error is still given to their waiters)."""
        if fut.exception() is not None:
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]

    def compile_now(self, params: StructuredOutputsParams, timeout_s: float = COMPILE_TIMEOUT_S) -> Grammar:
        """Compile (or fetch) and wait; ValueError with the reason if invalid or over the time limit."""
        fut = self.submit(params)
        try:
            return fut.result(timeout=timeout_s)
        except FutureTimeout:
            raise ValueError(f"structured_outputs.{params.kind}: grammar compilation exceeded the "
                             f"{timeout_s:g} s limit") from None

    def shutdown(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
