"""A request as the engine core sees it: token ids, progress, status."""

from __future__ import annotations

import enum
import time

import torch

from pagedllm.lora_request import LoRARequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # this request alone failed in the engine core (vLLM's FinishReason.ERROR)

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
FINISH_REASONS: tuple[str, ...] = tuple(_FINISH_REASONS.values())


class Request:
    """One sequence in the engine core.

    ``all_token_ids`` is prompt + output; ``num_computed_tokens`` of them have K/V in the
    cache. The scheduler's one rule: each step, give the request up to
    ``num_tokens - num_computed_tokens`` new tokens within the budget.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int],
        max_model_len: int,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = [] if sampling_params.ignore_eos else eos_token_ids
        self.stop_token_ids = set(sampling_params.stop_token_ids)
        max_tokens = sampling_params.max_tokens
        room = max_model_len - self.num_prompt_tokens
        self.max_tokens = room if max_tokens is None else min(max_tokens, room)
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # the adapter it runs with; None: the base model
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # This process's time.monotonic(): when the request was queued here, when it was first
        # scheduled (admitted; a preemption's readmission keeps it), and whether the front end
        # has been sent both (on the request's first output).
        self.queued_time = time.monotonic()
        self.scheduled_time: float | None = None
        self.times_sent = False

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.num_preemptions = 0
        # prompt_logprobs: prompt positions already scored (``build_step`` advances it), which
        # the recompute after a preemption does not score again.
        self.num_scored_prompt_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks (prefix caching)
        # Speculative decoding: draft tokens proposed after the last step, verified in the next
        # one; never part of ``all_token_ids``. ``spec_probs`` (FloatTensor[k, V]) is the
        # distribution each draft was drawn from, or None for drafts taken as certain (n-gram).
        self.spec_token_ids: list[int] = []
        self.spec_probs: torch.Tensor | None = None
        self.generator: torch.Generator | None = None
        # Set by the engine core for a request with ``structured_outputs``.
        self.structured_output: StructuredOutputRequest | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.structured_output is not None:
            self.structured_output.accept(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """Set a finished status if the last token ends the request; return whether it did.

        A complete grammar, EOS or a stop token id stops the request even at its last allowed
        token (vLLM's order), so an output that ended by itself never reads as cut off
        ("length"). A grammar complete below ``min_tokens`` does not stop it: only EOS may follow,
        which ``min_tokens`` masks, so its next step finds no token to sample and fails it alone
        (the request's two constraints contradict each other; neither is ignored).
        """
        below_min = self.num_output_tokens < self.sampling_params.min_tokens
        if self.structured_output is not None and self.structured_output.is_terminated:
            if self.structured_output.error is not None:
                self.status = RequestStatus.FINISHED_ERROR
                return True
            if not below_min or self.sampling_params.ignore_eos:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
        if not below_min:
            last = self.output_token_ids[-1]
            if last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in self.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
