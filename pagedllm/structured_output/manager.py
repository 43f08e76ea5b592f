"""Grammar compilation for the engine core: a background thread and a cache keyed by grammar."""

from __future__ import annotations

import concurrent.futures
import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from pagedllm.structured_output import backend
from pagedllm.structured_output.params import StructuredOutputsParams
from pagedllm.structured_output.request import StructuredOutputRequest

logger = logging.getLogger("pagedllm")

CACHE_SIZE = 256  # compiled grammars kept (initial-state matchers, a few hundred KB at most each)


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
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-grammar")
        self._cache: OrderedDict[tuple[str, str], Future[llguidance.LLMatcher]] = OrderedDict()

    def request_state(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A new sequence's grammar state; compiles in the background unless cached.

        Raises:
            InvalidParamError: ``params`` is malformed (the front end checks this first).
        """
        key = params.key
        compiled = self._cache.get(key)
        if compiled is None or (compiled.done() and compiled.exception() is not None):
            compiled = self._executor.submit(self._compile, params)
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return StructuredOutputRequest(compiled)

    def wait(self, states: list[StructuredOutputRequest], timeout: float) -> None:
        """Block until one of ``states`` finishes compiling, or ``timeout`` seconds: for a step
        loop that has nothing else to run."""
        pending = [s.compiled for s in states if not s.compiled.done()]
        if pending:
            concurrent.futures.wait(pending, timeout, concurrent.futures.FIRST_COMPLETED)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        if self._compiler is None:
            self._compiler = backend.Compiler(self._load_tokenizer(), self._vocab_size, self._eos_token_ids)
        return self._compiler.compile(backend.check(params))
