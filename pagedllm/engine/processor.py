"""Front-end input processing: validate, tokenize, fan a request out into ``n`` samples."""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams

PromptType = str | Sequence[int]


class Processor:
    """Turns user prompts into engine-core requests; raises ValueError on bad input.

    Args:
        tokenizer: a transformers tokenizer.
        max_model_len: longest prompt + output the engine serves.
        vocab_size: token ids must lie in [0, vocab_size).
        eos_token_ids: ids that end generation unless ``ignore_eos``.
    """

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids). Text is tokenized as the model expects (BOS if any)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> list[EngineCoreRequest]:
        """Validate one request and return its ``n`` engine-core requests ("{id}-{i}").

        Raises:
            ValueError: empty prompt, token ids outside the vocabulary, or prompt + max_tokens
                beyond max_model_len (the message gives the numbers).
        """
        n_prompt = len(prompt_token_ids)
        if n_prompt == 0:
            raise ValueError("the prompt is empty: it must have at least 1 token")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids entry {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        max_tokens = params.max_tokens if params.max_tokens is not None else 1
        if n_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{n_prompt} prompt tokens + {max_tokens} max_tokens = {n_prompt + max_tokens} were requested"
            )
        now = time.monotonic()
        requests = []
        for i in range(params.n):
            child = params
            if params.n > 1:  # each sample its own request; seeds differ so samples differ
                seed = None if params.seed is None else params.seed + i
                child = msgspec.structs.replace(params, n=1, seed=seed)
            requests.append(
                EngineCoreRequest(f"{request_id}-{i}", prompt_token_ids, child, self.eos_token_ids, now, cache_salt)
            )
        return requests
