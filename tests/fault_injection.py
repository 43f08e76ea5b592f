"""A model runner that injects faults, for the fault-isolation tests; never used in production.

Chosen with ``EngineConfig.model_runner_cls`` (``LLM(model_runner_cls=FAULTY_RUNNER)``), or
for a server and its engine core by ``PAGEDLLM_MODEL_RUNNER_CLS=tests.fault_injection:FaultyRunner``
in their environment (run from the repository root, so that ``tests`` imports). A request
whose ``cache_salt`` is ``"fault:<stage>"`` fails at that stage: "sample" (every sampling or
verification call that includes it raises), "logits" (its logits rows become NaN) or "token"
(its last sampled id is the one just past the vocabulary).
"""

from __future__ import annotations

import torch

from pagedllm.core.request import Request
from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.outputs import RequestError, TokenLogprobs
from pagedllm.worker.model_runner import ModelRunner

FAULTY_RUNNER = "tests.fault_injection:FaultyRunner"


class InjectedFault(RuntimeError):
    """Raised for a request marked "fault:sample"."""


def _marked(request: Request, stage: str) -> bool:
    return request.cache_salt == f"fault:{stage}"


class FaultyRunner(ModelRunner):
    """``ModelRunner`` with the faults of the module docstring."""

    def _sample_rows(
        self, logits: torch.Tensor, sample_rows: list[tuple[int, ScheduledRequest]], errors: dict[int, RequestError]
    ) -> dict[int, tuple[list[int], TokenLogprobs | None]]:
        for j, (_, s) in enumerate(sample_rows):
            if _marked(s.request, "logits"):
                logits[j] = float("nan")
        return super()._sample_rows(logits, sample_rows, errors)

    def _sample(self, logits: torch.Tensor, reqs: list[ScheduledRequest]) -> list[tuple[list[int], TokenLogprobs | None]]:
        if any(_marked(s.request, "sample") for s in reqs):
            raise InjectedFault("injected sampling fault")
        results = super()._sample(logits, reqs)
        return [
            ([self.config.vocab_size], lp) if _marked(s.request, "token") else (tokens, lp)
            for s, (tokens, lp) in zip(reqs, results)
        ]

    def _verify(
        self, all_logits: torch.Tensor, verify_rows: list[tuple[int, ScheduledRequest, int]]
    ) -> list[tuple[list[int], TokenLogprobs | None]]:
        if any(_marked(s.request, "sample") for _, s, _ in verify_rows):
            raise InjectedFault("injected verification fault")
        for _, s, first in verify_rows:
            if _marked(s.request, "logits"):
                all_logits[first : first + len(s.spec_token_ids) + 1] = float("nan")
        results = super()._verify(all_logits, verify_rows)
        return [
            ([*tokens[:-1], self.config.vocab_size], lp) if _marked(s.request, "token") else (tokens, lp)
            for (_, s, _), (tokens, lp) in zip(verify_rows, results)
        ]
