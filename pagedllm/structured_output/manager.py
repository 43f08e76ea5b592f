"""Grammar compilation for the engine core: background threads and a cache keyed by grammar,
bounded by bytes."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from pagedllm.errors import InvalidParamError
from pagedllm.structured_output import backend
from pagedllm.structured_output.cache import BoundedCache
from pagedllm.structured_output.grammar import grammar_text, short_error
from pagedllm.structured_output.params import StructuredOutputsParams
from pagedllm.structured_output.request import StructuredOutputRequest

logger = logging.getLogger("pagedllm")

# Compiled grammars kept: at most this many (a matcher for a schema of a few hundred properties
# holds about a megabyte)...
CACHE_SIZE = 64
CACHE_BYTES = 32 * 1024 * 1024  # ...and at most this much grammar text
COMPILE_THREADS = 2  # one slow grammar does not hold the others


class StructuredOutputManager:
    """Compiles each distinct grammar once, off the step loop, and hands out per-sequence states.

    Args:
        load_tokenizer: returns the model's transformers tokenizer; called once, in the
            compile thread, on the first constrained request (so unconstrained serving pays
            nothing at start-up).
        vocab_size: the width of the model's logits.
        eos_token_ids: the model's end-of-sequence ids.
    """

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, eos_token_ids: list[int]) -> None:
        self._load_tokenizer = load_tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._compiler: backend.Compiler | None = None
        self._executor = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="pagedllm-grammar")
        self._compiler_lock = threading.Lock()
        # Sized by the constraint's text (a matcher's size follows its grammar's).
        self._cache: BoundedCache[tuple[str, str], Future[llguidance.LLMatcher]] = BoundedCache(CACHE_SIZE, CACHE_BYTES)

    def request_state(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A new sequence's grammar state; compiles in the background unless cached.

        Raises:
            InvalidParamError: ``params`` is malformed (the front end checks this first).
        """
        key = params.key
        compiled = self._cache.get(key)
        if compiled is None or (compiled.done() and compiled.exception() is not None):
            compiled = self._executor.submit(self._compile, key)
            self._cache.put(key, compiled, len(key[1]))
        return StructuredOutputRequest(compiled)

    def wait(self, states: list[StructuredOutputRequest], timeout: float) -> None:
        """Block until one of ``states`` finishes compiling, or ``timeout`` seconds: for a step
        loop that has nothing else to run."""
        pending = [s.compiled for s in states if not s.compiled.done()]
        if pending:
            concurrent.futures.wait(pending, timeout, concurrent.futures.FIRST_COMPLETED)

    def _compile(self, key: tuple[str, str]) -> llguidance.LLMatcher:
        """A matcher for a constraint the front end has checked (in its grammar workers).

        Raises:
            InvalidParamError: it does not compile against this vocabulary (``param``
                ``structured_outputs``; a short message).
        """
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = backend.Compiler(self._load_tokenizer(), self._vocab_size, self._eos_token_ids)
        try:
            return self._compiler.compile(grammar_text(*key))
        except ValueError as e:
            raise InvalidParamError("structured_outputs", f"structured_outputs: {short_error(str(e))}") from None
