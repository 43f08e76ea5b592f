"""pagedllm: a high-throughput LLM inference and serving engine (paged KV cache, continuous batching)."""

import os
from typing import TYPE_CHECKING

# OpenMP threads that spin at barriers stall badly when another process (the API server,
# a tokenizer, anything) takes one of the few cores: measured 300 ms vs 49 ms per decode
# step on 2 busy cores. Sleeping waiters cost little on a quiet machine. This must be set
# before torch loads libgomp; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
