"""Runs one step: the forward pass over its flattened tokens (every rank), then sampling (rank 0).

A request with draft tokens (speculative decoding) is fed its last token and its drafts; the
logits at all ``1 + k`` positions go to the rejection sampler, which returns the accepted
drafts and one more token.

Structured outputs: the next-token masks of the requests with a grammar are filled into one
bitmask for the batch, which the sampler applies to those rows' logits (-inf for every token
the grammar forbids); rows without a grammar are untouched, and a batch without any costs
nothing. The masks of sampled rows fill in a background thread while the forward pass runs
(``start_masks``); those of verified rows (drafts) are filled before verifying.

Fault isolation: a request whose logits row is not finite, whose sampled id is outside the
vocabulary, or whose sampling, verification or logprob step raises is reported in
``ModelRunnerOutput.errors`` and gets no tokens; the other requests of the step keep theirs.
When a batched sampling stage raises, it is rerun one request at a time to find the culprit
(``fault_isolation``). A failing forward pass, or running out of memory, is no one request's
fault: it propagates.
Tests inject such faults with a subclass (``EngineConfig.model_runner_cls``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pagedllm.config import ModelConfig
from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedllm.layers.rejection_sampler import RejectionSampler
from pagedllm.layers.sampler import Sampler, in_this_thread
from pagedllm.layers.sampling_metadata import SamplingMetadata, SamplingRow
from pagedllm.outputs import RequestError, TokenLogprobs
from pagedllm.errors import InvalidParamError
from pagedllm.core.request import Request
from pagedllm.distributed.parallel_state import SINGLE, TPGroup
from pagedllm.structured_output.bitmask import PendingMasks, fill_bitmask
from pagedllm.worker.fault_isolation import FATAL, request_error, run_isolated
from pagedllm.worker.kv_cache import allocate_kv_caches, build_attention_metadata
from pagedllm.worker.lora_manager import LoRAManager
from pagedllm.worker.step_input import BlockTableMirror, SamplePlan, StepInput

logger = logging.getLogger("pagedllm")


def _constraint_field(request: Request) -> str:
    """The first field of ``request`` that can leave no token to sample, for its error's ``param``."""
    params = request.sampling_params
    for name in ("allowed_token_ids", "bad_words", "structured_outputs", "logit_bias"):
        if getattr(params, name):
            return name
    return "min_tokens" if params.min_tokens else "repetition_penalty"


@dataclass
class ModelRunnerOutput:
    """Per scheduled request, in the scheduler's order."""

    sampled: list[list[int]]  # new token ids (with drafts: the accepted ones, then one sampled); [] mid-prefill
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[TokenLogprobs | None]
    # Index of a request that failed alone -> why; it has no sampled tokens and must be finished.
    errors: dict[int, RequestError] = field(default_factory=dict)


class ModelRunner:
    """Owns the model and the KV caches; executes one step at a time.

    Args:
        model: the model (see ``pagedllm.models``), already loaded.
        config: its hyper-parameters.
        kv: the KV cache geometry (this rank's share).
        tp: this rank's tensor-parallel group; every rank runs :meth:`forward`, rank 0 alone
            :meth:`sample`.
        lora: the rank's LoRA adapters (``--enable-lora``), or None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        kv: KVCacheConfig,
        tp: TPGroup = SINGLE,
        lora: LoRAManager | None = None,
    ) -> None:
        self.model = model
        self.lora = lora
        self.tp = tp
        self.tables = BlockTableMirror(len(kv.groups))
        self.config = config
        self.block_size = kv.block_size
        self.groups = kv.groups
        self.kv_caches = allocate_kv_caches(kv)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self._started: tuple[SamplePlan, PendingMasks] | None = None  # by ``start_masks``
        self._masks: PendingMasks | None = None  # the masks of the step ``sample`` runs

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor | None:
        """Run one step's forward pass (every rank, the same ``step``).

        Returns:
            [len(step.logit_rows), V] float32 raw logits on rank 0; None on the other ranks
            (their share of the vocabulary is gathered on rank 0) or when no row needs them.
        """
        self.tables.apply(step)
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for r in step.requests:
            n = len(r.token_ids)
            token_ids += r.token_ids
            positions += range(r.num_computed_before, r.num_computed_before + n)
            query_lens.append(n)
            seq_lens.append(r.num_computed_before + n)
        meta = build_attention_metadata(
            self.groups, self.config.num_layers, query_lens, seq_lens,
            [self.tables[r.req_id] for r in step.requests], self.block_size, step.num_decode_requests,
        )
        if self.lora is not None:
            self.lora.begin_step(step.requests)
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), self.kv_caches, meta,
            len(token_ids) - step.num_prompt_rows,
        )
        return self.model.compute_logits(_rows(hidden, step.logit_rows)) if step.logit_rows else None

    def start_masks(self, plan: SamplePlan) -> None:
        """Start filling the grammar masks of ``plan``'s sampled rows in the background (rank 0,
        before ``forward``); ``sample`` of the same plan uses them, and without this call fills
        them itself."""
        grammars = [s.request.structured_output for _, s in plan.sample if s.request.structured_output is not None]
        self._started = (plan, PendingMasks(grammars, self.config.vocab_size)) if grammars else None

    @torch.inference_mode()
    def sample(self, sched: SchedulerOutput, plan: SamplePlan, logits: torch.Tensor | None) -> ModelRunnerOutput:
        """Sample, verify drafts and score prompts from rank 0's logits of the step (see the
        module docstring); the output is in the scheduler's order."""
        started, self._started = self._started, None
        self._masks = started[1] if started is not None and started[0] is plan else None
        n = len(sched.scheduled)
        sampled: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[TokenLogprobs | None] = [None] * n
        prompt_logprobs: list[TokenLogprobs | None] = [None] * n
        errors: dict[int, RequestError] = {}
        if logits is None:
            return ModelRunnerOutput(sampled, logprobs, prompt_logprobs, errors)

        base = plan.num_sample + plan.num_verify
        for i, s, first, position, rows in plan.prompt:
            try:
                prompt_logprobs[i] = self._prompt_logprobs(s.request, position, logits[base + first : base + first + rows])
            except FATAL:
                raise
            except Exception as e:
                errors[i] = request_error(s.request, "prompt logprobs", e)
        # A request whose prompt logprobs failed samples nothing this step.
        sample_keep = [j for j, (i, _) in enumerate(plan.sample) if i not in errors]
        verify_rows = [v for v in plan.verify if v[0] not in errors]
        if verify_rows:
            verify_logits = logits[plan.num_sample : base]
            results = run_isolated(
                lambda js: self._verify(verify_logits, [verify_rows[j] for j in js]),
                [(i, s.request) for i, s, _ in verify_rows], errors, "verification",
            )
            for (i, _, _), result in zip(verify_rows, results):
                if result is not None:
                    sampled[i], logprobs[i] = result
        if sample_keep:
            sample_logits = logits[: plan.num_sample]
            if len(sample_keep) < len(plan.sample):
                sample_logits = sample_logits[sample_keep]
            for i, result in self._sample_rows(sample_logits, [plan.sample[j] for j in sample_keep], errors).items():
                sampled[i], logprobs[i] = result
        for i, tokens in enumerate(sampled):
            # A token id the embedding cannot look up would crash the next step for everyone.
            bad = [t for t in tokens if not 0 <= t < self.config.vocab_size]
            if bad:
                errors[i] = RequestError(f"sampled token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
                logger.error("request %s: %s", sched.scheduled[i].request.request_id, errors[i].message)
                sampled[i], logprobs[i] = [], None
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs, errors)

    def _sample_rows(
        self, logits: torch.Tensor, sample_rows: list[tuple[int, ScheduledRequest]], errors: dict[int, RequestError]
    ) -> dict[int, tuple[list[int], TokenLogprobs | None]]:
        """Sample the next token of each request from its raw logits row ([B, V] float32).

        Returns:
            Output index -> (one token, its logprobs or None), for the requests that did not
            fail; those that did are in ``errors``.
        """
        # NaN beats every value in argmax and poisons a softmax: nothing sampled from such a
        # row means anything. Raw logits are finite unless something broke. A row's sum is
        # finite exactly when all its values are (short of a sum past 3.4e38), and one vectorized
        # reduction costs a fraction of isfinite's elementwise pass and its boolean tensor. In
        # numpy, in this thread: torch would wake its thread team for a pass this small.
        finite = np.isfinite(logits.numpy().sum(axis=-1)).tolist()
        if not all(finite):
            for j, (i, s) in enumerate(sample_rows):
                if not finite[j]:
                    errors[i] = RequestError(f"the model produced non-finite logits for request {s.request.request_id}")
                    logger.error("%s", errors[i].message)
            keep = [j for j, ok in enumerate(finite) if ok]
            logits, sample_rows = logits[keep], [sample_rows[j] for j in keep]
        if not sample_rows:
            return {}
        results = run_isolated(
            lambda js: self._sample(_rows(logits, js), [sample_rows[j][1] for j in js]),
            [(i, s.request) for i, s in sample_rows], errors, "sampling",
        )
        return {i: result for (i, _), result in zip(sample_rows, results) if result is not None}

    def _sample(
        self, logits: torch.Tensor, reqs: list[ScheduledRequest]
    ) -> list[tuple[list[int], TokenLogprobs | None]]:
        """Sample one token per row of ``logits`` ([B, V] float, raw) and its logprobs if asked."""
        rows = [
            SamplingRow(
                params=s.request.sampling_params,
                prompt_token_ids=s.request.prompt_token_ids,
                output_token_ids=s.request.output_token_ids,
                generator=s.request.generator,
                eos_token_ids=s.request.eos_token_ids,
            )
            for s in reqs
        ]
        meta = SamplingMetadata.build(rows)
        constrained = [j for j, s in enumerate(reqs) if s.request.structured_output is not None]
        if constrained:
            grammars = [reqs[j].request.structured_output for j in constrained]
            bitmask = fill_bitmask(grammars, logits.shape[1]) if self._masks is None else self._masks.masks(grammars)
            meta = replace(meta, grammar_mask=(bitmask, constrained))
            failed = next((e for g in grammars if (e := g.error) is not None), None)
            if failed is not None:  # fails this batch; ``run_isolated`` retries each alone
                raise failed
        out = self.sampler(logits, meta)
        if out.unsamplable:  # fails this batch; ``run_isolated`` retries each request alone
            raise InvalidParamError(
                _constraint_field(reqs[0].request),
                "no token can be sampled: the request's allowed_token_ids, bad_words, structured output, "
                "min_tokens and penalties leave no token with a finite logit",
            )
        tokens = out.sampled_token_ids.tolist()
        results: list[tuple[list[int], TokenLogprobs | None]] = []
        for j, s in enumerate(reqs):
            lp = None
            if out.logprobs is not None and s.request.sampling_params.logprobs is not None:
                num = s.request.sampling_params.logprobs + 1
                lp = TokenLogprobs(
                    [out.logprobs.token_ids[j, :num].tolist()],
                    [out.logprobs.logprobs[j, :num].tolist()],
                    [int(out.logprobs.ranks[j])],
                )
            results.append(([tokens[j]], lp))
        return results

    def _verify(
        self, all_logits: torch.Tensor, verify_rows: list[tuple[int, ScheduledRequest, int]]
    ) -> list[tuple[list[int], TokenLogprobs | None]]:
        """Rejection-sample the requests with drafts: (accepted tokens, their logprobs) per request.

        Args:
            all_logits: [R, V] float32 raw logits of the verified rows.
            verify_rows: (output index, request, row in ``all_logits`` of its last known token);
                its drafts' rows follow that row.

        Raises:
            ValueError: if a request's logits at a verified position are not finite.
        """
        idx: list[int] = []
        rows: list[SamplingRow] = []
        for _, s, first in verify_rows:
            r, k = s.request, len(s.spec_token_ids)
            idx.extend(range(first, first + k + 1))
            # Position j is sampled as if drafts 0..j-1 were already output (penalties, min_tokens).
            rows.extend(
                SamplingRow(
                    params=r.sampling_params,
                    prompt_token_ids=r.prompt_token_ids,
                    output_token_ids=r.output_token_ids + s.spec_token_ids[:j],
                    eos_token_ids=r.eos_token_ids,
                )
                for j in range(k + 1)
            )
        # As sample's check: one sum in numpy, in this thread (torch's isfinite and gather wake
        # its thread team for passes this small: docs/benchmarks.md, "Intel Xeon, session 19").
        if in_this_thread(all_logits):
            logits = torch.from_numpy(all_logits.numpy()[idx])
            finite = bool(np.isfinite(logits.numpy().sum()))
        else:
            logits = all_logits[idx]
            finite = bool(torch.isfinite(logits).all())
        if not finite:
            raise ValueError("the model produced non-finite logits")
        accepted = self.rejection_sampler(
            logits,
            _with_grammar_masks(SamplingMetadata.build(rows), [s for _, s, _ in verify_rows], logits.shape[1]),
            [s.spec_token_ids for _, s, _ in verify_rows],
            [s.spec_probs for _, s, _ in verify_rows],
            [s.request.generator for _, s, _ in verify_rows],
        )
        results: list[tuple[list[int], TokenLogprobs | None]] = []
        row = 0
        for (_, s, _), tokens in zip(verify_rows, accepted):
            lp = None
            num = s.request.sampling_params.logprobs
            if num is not None:  # raw logprobs of each emitted token, at its own position
                ids, lps, ranks = self.sampler.logprobs(
                    logits[row : row + len(tokens)], torch.tensor(tokens, dtype=torch.long), num
                )
                lp = TokenLogprobs(ids.tolist(), lps.tolist(), ranks.tolist())
            results.append((tokens, lp))
            row += len(s.spec_token_ids) + 1
        return results

    def _prompt_logprobs(self, request: Request, position: int, logits: torch.Tensor) -> TokenLogprobs:
        """Log-probabilities of the prompt tokens after ``position`` and the R - 1 positions that
        follow it (token p+1 from position p).

        Args:
            logits: [R, V] float32 raw logits of positions ``position`` .. ``position + R - 1``, R > 0.
        """
        end = position + logits.shape[0]
        targets = torch.tensor(request.prompt_token_ids[position + 1 : end + 1], dtype=torch.long)
        top_ids, top_lps, ranks = self.sampler.logprobs(logits, targets, request.sampling_params.prompt_logprobs)
        return TokenLogprobs(top_ids.tolist(), top_lps.tolist(), ranks.tolist())


def _with_grammar_masks(meta: SamplingMetadata, reqs: list[ScheduledRequest], vocab_size: int) -> SamplingMetadata:
    """``meta`` of a verification batch with the grammar masks of its constrained requests.

    Request b owns k_b + 1 consecutive rows; the mask at draft position i is the grammar's
    after drafts 0..i-1 (the engine cut the drafts to the grammar's valid prefix, but for a
    sampled draft it forbids, kept last: see ``fill_bitmask``).
    """
    grammars, drafts, rows, row = [], [], [], 0
    for s in reqs:
        k = len(s.spec_token_ids)
        if s.request.structured_output is not None:
            grammars.append(s.request.structured_output)
            drafts.append(s.spec_token_ids)
            rows.extend(range(row, row + k + 1))
        row += k + 1
    if not grammars:
        return meta
    return replace(meta, grammar_mask=(fill_bitmask(grammars, vocab_size, drafts), rows))


def _rows(t: torch.Tensor, js: list[int]) -> torch.Tensor:
    """Rows ``js`` of ``t``, in that order: a view where they are consecutive (``t`` itself for
    all of its rows), else a copy by ``index_select``, which gathers a few rows in this thread.

    Why: ``t[js]`` starts torch's thread team on every step (a decode step's logit rows are
    consecutive), and where torch was imported before pagedllm set OpenMP's wait policy
    (``pagedllm/__init__.py``) that team then spins on the cores the kernels' team needs.
    """
    first = js[0] if js else 0
    if js == list(range(first, first + len(js))):
        return t[first : first + len(js)]
    return t.index_select(0, torch.tensor(js, dtype=torch.long))
