"""pagedllm: a high-throughput LLM inference and serving engine (paged KV cache, continuous batching)."""

import os
from typing import TYPE_CHECKING

# How long OpenMP threads spin at a barrier before sleeping. A decode step is hundreds of
# small parallel regions a few microseconds apart: sleeping waiters (OMP_WAIT_POLICY=PASSIVE)
# pay a wake-up at each, and endless spinning stalls whenever another process holds a core;
# a bounded spin (about 10,000 iterations) keeps the quiet-machine speed without the stalls
# (docs/benchmarks.md, GOMP_SPINCOUNT). Set before torch loads libgomp; a user's own
# OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
