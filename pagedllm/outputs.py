"""Result types: what the engine core returns per step and what users receive."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from pagedllm.lora_request import LoRARequest


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Top-N log-probabilities at consecutive positions (sampled or prompt tokens).

    Per position: ``token_ids[i][0]`` is the chosen token, the rest the top-N in order;
    ``logprobs[i]`` are their natural-log probabilities (float); ``ranks[i]`` is the chosen
    token's rank in the vocabulary (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def first(self, n: int) -> TokenLogprobs:
        """The first ``n`` positions (self when it has no more)."""
        if len(self.ranks) <= n:
            return self
        return TokenLogprobs(self.token_ids[:n], self.logprobs[:n], self.ranks[:n])

    def extend(self, other: TokenLogprobs) -> None:
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.ranks.extend(other.ranks)


class RequestError(msgspec.Struct, array_like=True, omit_defaults=True):
    """Why the engine ended one request with finish_reason "error".

    ``param`` is set when the request's own input caused it (a constraint that no token can
    satisfy, a grammar that fails while generating): the client's error, naming the field
    (a 400 over HTTP). Without it the failure is the engine's (a 500).
    """

    message: str
    param: str | None = None

    @classmethod
    def of(cls, error: Exception) -> RequestError:
        """The client's error when ``error`` names a field (``InvalidParamError``), else the engine's."""
        param = getattr(error, "param", None)
        return cls(str(error), param) if param else cls(f"{type(error).__name__}: {error}")


@dataclass
class Logprob:
    """One token's log-probability, as in vLLM's ``Logprob``."""

    logprob: float
    rank: int | None = None
    # The token's share of the text: "" for a token that holds only part of a UTF-8 character;
    # the token that completes a character carries all of it (vLLM's convention).
    decoded_token: str | None = None
    token_bytes: bytes | None = None  # the token's own raw bytes (UTF-8, or raw byte-level/byte-fallback bytes)


# Per position: {token_id: Logprob}; the chosen token is included (vLLM's shape).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    error: str | None = None  # with finish_reason "error": why the engine failed this sample
    error_param: str | None = None  # with ``error``: the request field at fault, when it was the client's
    lora_request: LoRARequest | None = None  # the adapter it ran with (vLLM's field)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # first entry None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    lora_request: LoRARequest | None = None  # the adapter it ran with (vLLM's field)
