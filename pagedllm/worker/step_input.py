"""One step as every tensor-parallel rank runs it, built once on rank 0 from the scheduler's output.

Rank 0 turns a ``SchedulerOutput`` into a :class:`StepInput` (:func:`build_step`), sends it to
the other ranks, and every rank, rank 0 included, runs the same forward pass over it
(``ModelRunner.forward``). The step carries diffs, not state (vLLM V1's scheduler output): per
scheduled request its new token ids (drafts included) and ``num_computed_tokens`` before them,
the changes to its block tables, and the requests whose tables are to be dropped. Each rank
keeps its tables in a :class:`BlockTableMirror` that applies them. Sampling, stop checks and
grammars stay on rank 0, which owns the requests: :class:`SamplePlan` says which logits rows
belong to which request, and never leaves rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from pagedllm.core.kv_events import BlockTableUpdate
from pagedllm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedllm.lora_request import LoRARequest


class RequestTokens(msgspec.Struct, array_like=True):
    """One scheduled request's share of the step: its tokens sit at positions
    ``num_computed_before, num_computed_before + 1, ...``; ``lora``: its adapter, or None."""

    req_id: str
    num_computed_before: int
    token_ids: list[int]
    lora: LoRARequest | None = None


class StepInput(msgspec.Struct, array_like=True):
    """One step for every rank, or the order to stop.

    Attributes:
        requests: the scheduled requests in forward order: those past their prompts first
            (decodes, speculative verification, a recomputed request's outputs), then prompt
            chunks; each kind ordered by LoRA adapter id (the base model's first), so each
            adapter's tokens form runs.
        block_updates: changes to the block tables of those requests, applied in order.
        finished_req_ids: requests whose tables are dropped, before the updates apply.
        logit_rows: rows of the step's hidden states the logits are computed for, in order.
        shutdown: leave the step loop (every other field empty).
        num_decode_requests: the leading requests, those past their prompts (not ``in_prompt``),
            whose every row is a query of the decode attention kernel
            (``AttentionMetadata.build``).
        num_prompt_rows: the trailing rows that are prompt chunks' (``in_prompt``), which
            linear layers with a prompt kernel compute on it (``kernels.linear.linear_w8a8``).
    """

    requests: list[RequestTokens] = []
    block_updates: list[BlockTableUpdate] = []
    finished_req_ids: list[str] = []
    logit_rows: list[int] = []
    shutdown: bool = False
    num_decode_requests: int = 0
    num_prompt_rows: int = 0


@dataclass
class SamplePlan:
    """Where each request's logits are, in the rows of ``StepInput.logit_rows`` (rank 0 only).

    The rows come in three runs: one per sampling request, then ``1 + k`` per request verifying
    ``k`` drafts, then the prompt-logprob rows.

    Attributes:
        sample: (scheduler index, request) per sampled row, in row order.
        verify: (scheduler index, request, first row within the verify run).
        prompt: (scheduler index, request, first row within the prompt run, first prompt position
            scored, rows): position p's row scores prompt token p + 1.
        num_sample, num_verify: the rows of the first two runs.
    """

    sample: list[tuple[int, ScheduledRequest]] = field(default_factory=list)
    verify: list[tuple[int, ScheduledRequest, int]] = field(default_factory=list)
    prompt: list[tuple[int, ScheduledRequest, int, int, int]] = field(default_factory=list)
    num_sample: int = 0
    num_verify: int = 0


def in_prompt(s: ScheduledRequest) -> bool:
    """Whether a scheduled request's tokens are a chunk of its prompt (from its first token on,
    after a prefix-cache hit, or recomputed after a preemption; the scheduler ends such a chunk
    at the prompt's end, so it holds no outputs): they take the prompt kernels whatever the
    chunking, a one-token chunk too, so a prompt's bits do not depend on it (README, "Linear
    layers"). The other requests' rows (a decode's, a speculative verification's, a recomputed
    run of outputs) take the decode attention kernel, each row a query of its own, so that
    every token past the prompt is computed as a decode step computes it: the two attention
    kernels sum in other orders, which int8 activations can turn into a flipped near-tie."""
    return s.num_computed_before < s.request.num_prompt_tokens


def forward_order(sched: SchedulerOutput) -> list[int]:
    """The indices of ``sched.scheduled`` in the step's row order: the requests past their
    prompts first (the decode attention kernel's rows, in one call), prompt chunks last (one run
    of rows for their kernels); within each, by LoRA adapter id (one run per adapter)."""
    def key(i: int) -> tuple[int, int]:
        s = sched.scheduled[i]
        return int(in_prompt(s)), 0 if s.request.lora_request is None else s.request.lora_request.id

    return sorted(range(len(sched.scheduled)), key=key)


def build_step(sched: SchedulerOutput) -> tuple[StepInput, SamplePlan]:
    """The step every rank runs for ``sched``, and rank 0's plan for its logits. Advances each
    planned request's ``num_scored_prompt_tokens`` past the prompt positions the plan scores."""
    order = forward_order(sched)
    requests: list[RequestTokens] = []
    updates: list[BlockTableUpdate] = []
    plan = SamplePlan()
    sample_idx: list[int] = []
    verify_idx: list[int] = []
    prompt_idx: list[int] = []
    num_tokens = 0
    for i in order:
        s = sched.scheduled[i]
        request = s.request
        start = s.num_computed_before
        end = start + s.num_new_tokens - len(s.spec_token_ids)  # the last known token, then the drafts
        tokens = request.all_token_ids[start:end] + s.spec_token_ids
        first = num_tokens
        num_tokens += len(tokens)
        requests.append(RequestTokens(request.request_id, start, tokens, request.lora_request))
        updates += s.block_updates
        if request.sampling_params.prompt_logprobs is not None:
            # Token p + 1 is predicted from position p, up to the prompt's last token; positions
            # scored before a preemption are not scored again when they are recomputed.
            lo = max(start, request.num_scored_prompt_tokens)
            rows = min(end, request.num_prompt_tokens - 1) - lo
            if rows > 0:
                plan.prompt.append((i, s, len(prompt_idx), lo, rows))
                prompt_idx.extend(range(first + lo - start, first + lo - start + rows))
                request.num_scored_prompt_tokens = lo + rows
        if s.spec_token_ids:
            plan.verify.append((i, s, len(verify_idx)))
            verify_idx.extend(range(num_tokens - len(s.spec_token_ids) - 1, num_tokens))
        elif s.samples:
            sample_idx.append(num_tokens - 1)
            plan.sample.append((i, s))
    plan.num_sample, plan.num_verify = len(sample_idx), len(verify_idx)
    num_decode_requests = sum(not in_prompt(s) for s in sched.scheduled)
    num_prompt_rows = sum(s.num_new_tokens for s in sched.scheduled if in_prompt(s))
    step = StepInput(
        requests, updates, sched.finished_req_ids, sample_idx + verify_idx + prompt_idx,
        num_decode_requests=num_decode_requests, num_prompt_rows=num_prompt_rows,
    )
    return step, plan


class BlockTableMirror:
    """A rank's copy of the scheduler's block tables, kept by applying each step's diffs.

    Args:
        num_groups: KV cache groups (one table per group and request).
    """

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.tables: dict[str, list[list[int]]] = {}

    def apply(self, step: StepInput) -> None:
        """Drop the finished requests' tables, then apply the updates."""
        tables = self.tables
        for rid in step.finished_req_ids:
            tables.pop(rid, None)
        for u in step.block_updates:
            table = tables.get(u.req_id)
            if table is None:
                table = tables[u.req_id] = [[] for _ in range(self.num_groups)]
            del table[u.group][u.start :]
            table[u.group].extend(u.block_ids)

    def __getitem__(self, req_id: str) -> list[list[int]]:
        """The request's table per group."""
        return self.tables[req_id]
