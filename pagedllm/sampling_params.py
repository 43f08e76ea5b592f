"""Per-request sampling parameters, with vLLM's names and semantics."""

from __future__ import annotations

import msgspec

_GREEDY_EPS = 1e-5


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request's output tokens.

    A msgspec struct, so it crosses the front-end/engine-core boundary without pickle.
    ``temperature == 0`` means greedy. Penalties follow vLLM: ``presence_penalty`` and
    ``frequency_penalty`` act on output tokens only (OpenAI's definition),
    ``repetition_penalty`` on prompt and output tokens (CTRL, Keskar et al. 2019, §4.1).

    Raises:
        ValueError: at construction, for any value outside its allowed range; the
            message names the field, the value and the range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def bad(field: str, value: object, allowed: str) -> ValueError:
            return ValueError(f"{field} must be {allowed}, got {value!r}")

        if self.n < 1:
            raise bad("n", self.n, "at least 1")
        if self.temperature < 0.0:
            raise bad("temperature", self.temperature, "non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", self.top_k, "0 or -1 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", self.repetition_penalty, "in (0, 2]")
        # max_tokens == 0 only scores the prompt (echo + logprobs), as evaluation harnesses do.
        min_max_tokens = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens is not None and self.max_tokens < min_max_tokens:
            raise bad("max_tokens", self.max_tokens, "at least 1 (0 only with prompt_logprobs)")
        if self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"at most max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", self.logprobs, "in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", self.prompt_logprobs, "in [0, 20]")
        if any(not s for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
