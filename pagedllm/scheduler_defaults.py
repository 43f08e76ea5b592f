"""The scheduler's token budget per step (``max_num_batched_tokens``) when none is given.

Its own module, importing nothing, so that the command line can show the defaults without
loading torch.
"""

# Offline (LLM, generate, chat, bench): large steps, the prompts of a batch in few of them.
MAX_NUM_BATCHED_TOKENS = 2048

# `pagedllm serve`: the smallest budget of a sweep of time to first token and time per output
# token under 16 and 32 streams, on AVX-512 and AVX2 kernels alike (docs/benchmarks.md, "Time to
# first token against the scheduler's token budget"): prompts go in one after another, so the
# median first token waits half a wave of prompts instead of all of it.
SERVE_MAX_NUM_BATCHED_TOKENS = 256
