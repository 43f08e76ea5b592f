"""The unified token scheduler (vLLM V1 semantics).

There is no prefill phase and no decode phase. Each step hands out a token budget
(``max_num_batched_tokens``) and at most ``max_num_seqs`` running requests; every request
is given ``min(num_tokens - num_computed_tokens, budget left)`` new tokens (and at most
``long_prefill_token_threshold`` when that is set), running requests first, then waiting ones
in arrival order (FCFS). A fresh request is a prefill, a long one is
a chunked prefill, one with a single token to go is a decode, a prefix-cache hit starts
with ``num_computed_tokens > 0``. When a block cannot be allocated, the most recently
admitted running request is preempted: its blocks are freed and it is recomputed later.
While others run, a waiting request is admitted only when the free blocks hold all of its
prompt, not just this step's chunk: half a prompt that cannot finish would hold blocks the
running requests' decodes need, and be the one preempted for them (recomputing a long prompt
costs seconds on a CPU).

Speculative decoding fits the same rule: a decoding request's draft tokens
(``request.spec_token_ids``) are tokens not yet computed, so it is scheduled ``1 + k`` tokens
within the budget, the drafts' slots allocated as lookahead slots (never prefix-cached).
After verification the rejected drafts are rolled back: ``num_computed_tokens`` goes back
and blocks that held only rejected drafts return to the pool.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_events import BlockTableUpdate
from pagedllm.core.request import Request, RequestStatus
from pagedllm.outputs import RequestError
from pagedllm.errors import InvalidParamError
from pagedllm.core.spec_decode_stats import SpecDecodingStats

logger = logging.getLogger("pagedllm")


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, from num_computed_before on (drafts included)
    num_computed_before: int
    block_updates: list[BlockTableUpdate]  # its block tables' changes since it was last scheduled
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens verified this step
    spec_probs: torch.Tensor | None = None  # FloatTensor[len(spec_token_ids), V]; None: n-gram

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token, so a new token is sampled."""
        return self.num_computed_before + self.num_new_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[str, RequestError]] = field(default_factory=list)  # (request id, error): finished, blocks freed
    # Requests whose blocks were freed (finished, aborted, failed, preempted) since the last
    # step that scheduled anything: the workers drop their block tables.
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Args:
        kv_cache: the block allocator.
        max_num_seqs: cap on running requests.
        max_num_batched_tokens: token budget per step.
        max_model_len: longest sequence (prompt + output) a request may reach.
        max_loras: most distinct LoRA adapters among the running requests (None: no cap); a
            waiting request of another adapter waits until one of them has no request left.
        long_prefill_token_threshold: most tokens one request computes in a step (0: no cap),
            so that several long prompts advance side by side instead of one after another.
    """

    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_loras: int | None = None,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.kv_cache = kv_cache
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.freed_req_ids: list[str] = []  # for the next SchedulerOutput.finished_req_ids
        self.spec_stats = SpecDecodingStats()

    # -- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests from outside (abort, or a stop string found by the front end)."""
        ended = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            ended.append(request)
        return ended

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            try:
                num_new = self._num_new(request, budget)
                num_drafts = self._num_drafts(request, num_new, budget)
                while not self.kv_cache.allocate_slots(request, num_new, num_lookahead_tokens=num_drafts):
                    if num_drafts:  # drafts are optional: drop them before preempting anyone
                        num_drafts = 0
                        continue
                    if len(self.running) == 1:  # alone and still no room: it never will be
                        raise self._never_fits(request)
                    victim = self.running.pop()  # the most recently admitted
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is request:
                        break
                else:
                    self._schedule(out, request, num_new, num_drafts)
                    budget -= num_new + num_drafts
                    i += 1
            except Exception as e:  # this request's fault: it leaves self.running, so i stays
                self._fail(out, request, e)

        # Grammars not compiled yet, adapters beyond max_loras: skipped this step, order kept.
        deferred: deque[Request] = deque()
        adapters = {r.lora_request.id for r in self.running if r.lora_request is not None}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if out.preempted:  # no room for newcomers in a step that had to preempt
                break
            request = self.waiting[0]
            try:
                if request.structured_output is not None and not request.structured_output.is_ready:
                    deferred.append(self.waiting.popleft())
                    continue
                lora = request.lora_request
                if lora is not None and self.max_loras is not None and lora.id not in adapters:
                    if len(adapters) >= self.max_loras:
                        deferred.append(self.waiting.popleft())
                        continue
                blocks, num_hit = [], 0
                if request.num_computed_tokens == 0:
                    blocks, num_hit = self.kv_cache.get_computed_blocks(request)
                request.num_computed_tokens = num_hit
                num_new = self._num_new(request, budget)
                # Its later chunks must fit too while others run (alone, nobody's decode competes).
                rest = request.num_tokens - request.num_computed_tokens - num_new if self.running else 0
                if not self.kv_cache.allocate_slots(request, num_new, blocks, num_reserved_tokens=rest):
                    request.num_computed_tokens = 0
                    if not self.running:  # every block is free or evictable: it never fits
                        raise self._never_fits(request)
                    break
                self.waiting.popleft()
                if request.num_cached_tokens < 0:  # first admission: the hit it reports and the metric counts
                    request.num_cached_tokens = num_hit
                    request.scheduled_time = time.monotonic()
                    self.kv_cache.count_prefix_hit(request, num_hit)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                if lora is not None:
                    adapters.add(lora.id)
                self._schedule(out, request, num_new)
                budget -= num_new
            except Exception as e:
                self._fail(out, request, e)
        self.waiting.extendleft(reversed(deferred))
        if out.scheduled:  # an empty step runs nothing, so nothing reaches the workers
            out.finished_req_ids, self.freed_req_ids = self.freed_req_ids, []
        return out

    @property
    def compiling(self) -> list[Request]:
        """Waiting requests whose grammar is still compiling."""
        return [r for r in self.waiting if r.structured_output is not None and not r.structured_output.compiled.done()]

    def _never_fits(self, request: Request) -> ValueError:
        """The error of a request the whole KV cache cannot hold (the front end's length check
        keeps these out; failing them here keeps one from blocking the queue forever)."""
        return ValueError(
            f"{request.num_tokens} tokens do not fit in the KV cache ({self.kv_cache.pool.num_blocks} blocks; "
            f"max_model_len {self.max_model_len})"
        )

    def _fail(self, out: SchedulerOutput, request: Request, error: Exception) -> None:
        """Finish a request whose scheduling raised, free its blocks and report it in ``out.failed``."""
        if isinstance(error, InvalidParamError):  # the request's own input (its grammar): no traceback
            logger.warning("request %s failed while being scheduled: %s", request.request_id, error)
        else:
            logger.exception("request %s failed while being scheduled", request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        out.scheduled = [s for s in out.scheduled if s.request is not request]
        request.status = RequestStatus.FINISHED_ERROR
        self._free(request)
        out.failed.append((request.request_id, RequestError.of(error) if isinstance(error, InvalidParamError)
                           else RequestError(f"scheduling failed: {type(error).__name__}: {error}")))

    def _num_new(self, request: Request, budget: int) -> int:
        """The tokens ``request`` computes this step from its ``num_computed_tokens`` on. A
        chunk that starts in the prompt ends at its end at the latest: after a preemption the
        outputs are recomputed in the next step, as rows past the prompt (step_input's
        ``in_prompt``), on the kernels that computed them the first time."""
        num_new = request.num_tokens - request.num_computed_tokens
        if request.num_computed_tokens < request.num_prompt_tokens:
            num_new = min(num_new, request.num_prompt_tokens - request.num_computed_tokens)
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        return min(num_new, budget)

    def _num_drafts(self, request: Request, num_new: int, budget: int) -> int:
        """How many of the request's draft tokens to verify this step (they follow its last token)."""
        if not request.spec_token_ids or request.num_computed_tokens + num_new < request.num_tokens:
            return 0
        # A verification emits one token beyond its accepted drafts: drafts past
        # max_tokens - 1 could never be kept.
        room = request.max_tokens - request.num_output_tokens - 1
        return max(0, min(len(request.spec_token_ids), budget - num_new, room))

    def _schedule(self, out: SchedulerOutput, request: Request, num_new: int, num_drafts: int = 0) -> None:
        drafts = request.spec_token_ids[:num_drafts]
        probs = None if request.spec_probs is None or not drafts else request.spec_probs[:num_drafts]
        request.spec_token_ids, request.spec_probs = [], None  # consumed; the proposer drafts anew
        out.scheduled.append(
            ScheduledRequest(
                request,
                num_new + num_drafts,
                request.num_computed_tokens,
                self.kv_cache.take_block_updates(request.request_id),
                drafts,
                probs,
            )
        )
        out.num_batched_tokens += num_new + num_drafts
        request.num_computed_tokens += num_new + num_drafts

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        self.freed_req_ids.append(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_probs = [], None
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- after the forward pass ----------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled: list[list[int]]
    ) -> list[tuple[ScheduledRequest, list[int]]]:
        """Append each request's sampled tokens and finish those that hit a stop condition.

        Args:
            sampled: per scheduled request (same order), the token ids it accepted this
                step: empty for a prefill chunk that did not reach the end of the prompt;
                with draft tokens, the accepted drafts then one sampled token (so the
                drafts past ``len - 1`` were rejected and are rolled back here).

        Returns:
            (scheduled request, new token ids) for every request with new tokens or that
            finished; finished requests have their blocks freed already.
        """
        results = []
        for sched, new_tokens in zip(out.scheduled, sampled):
            request = sched.request
            if request.is_finished or not new_tokens:  # aborted meanwhile, or mid-prefill
                continue
            if sched.spec_token_ids:
                self._roll_back_rejected(sched, len(new_tokens) - 1)
            accepted: list[int] = []
            if request.max_tokens == 0:  # prompt scoring only: done once the prompt is computed
                request.status = RequestStatus.FINISHED_LENGTH
                new_tokens = []
                self.running.remove(request)
                self._free(request)
            for token in new_tokens:
                request.append_output_token(token)
                accepted.append(token)
                if request.check_stop(self.max_model_len):
                    self.running.remove(request)
                    self._free(request)
                    break
            results.append((sched, accepted))
        return results

    def _roll_back_rejected(self, sched: ScheduledRequest, num_accepted: int) -> None:
        """Forget the K/V of the drafts after the first ``num_accepted``; free blocks they alone used."""
        request = sched.request
        num_drafts = len(sched.spec_token_ids)
        self.spec_stats.observe(num_drafts, num_accepted)
        if num_accepted < num_drafts:
            request.num_computed_tokens -= num_drafts - num_accepted
            self.kv_cache.trim(request, request.num_computed_tokens)

    def _free(self, request: Request) -> None:
        self.kv_cache.free(request)
        self.freed_req_ids.append(request.request_id)
        del self.requests[request.request_id]
