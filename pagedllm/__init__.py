"""pagedllm: a high-throughput LLM inference and serving engine (paged KV cache, continuous batching)."""

import os
from typing import TYPE_CHECKING

# OpenMP threads (torch's, and the kernels' roofline probes) sleep when they wait instead of
# spinning: the kernels split their work over their own thread team (csrc/parallel.h), so a
# step holds few OpenMP regions, and spinning OpenMP waiters take the cores the team runs on
# (docs/benchmarks.md, "Threads on shared cores"). Set before torch loads libgomp; a user's
# own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
if "GOMP_SPINCOUNT" not in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.structured_output import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM

__all__ = [
    "LLM", "LoRARequest", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "RequestOutput",
    "CompletionOutput", "Logprob",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
