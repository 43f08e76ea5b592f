"""Turns a scheduler step into one forward pass over the flattened tokens, then samples.

A request with draft tokens (speculative decoding) is fed its last token and its drafts; the
logits at all ``1 + k`` positions go to the rejection sampler, which returns the accepted
drafts and one more token.

Structured outputs: before sampling (or verifying), the next-token masks of the requests
with a grammar are filled into one bitmask for the batch, which the sampler applies to
those rows' logits (-inf for every token the grammar forbids); rows without a grammar are
untouched, and a batch without any costs nothing.

Fault isolation: a request whose logits row is not finite, whose sampled id is outside the
vocabulary, or whose sampling, verification or logprob step raises is reported in
``ModelRunnerOutput.errors`` and gets no tokens; the other requests of the step keep theirs.
When a batched sampling stage raises, it is rerun one request at a time to find the culprit.
A failing forward pass, or running out of memory, is no one request's fault: it propagates.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import msgspec
import torch

from pagedllm.config import ModelConfig
from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedllm.layers.rejection_sampler import RejectionSampler
from pagedllm.layers.sampler import Sampler, compute_logprobs
from pagedllm.layers.sampling_metadata import SamplingMetadata, SamplingRow
from pagedllm.outputs import RequestError, TokenLogprobs
from pagedllm.errors import InvalidParamError
from pagedllm.core.request import Request
from pagedllm.distributed.parallel_state import SINGLE, TPGroup
from pagedllm.structured_output.bitmask import fill_bitmask
from pagedllm.structured_output.grammar import short_error
from pagedllm.worker.kv_cache import allocate_kv_caches, build_attention_metadata
from pagedllm.worker.step_input import BlockTableMirror, StepInput, apply_updates

logger = logging.getLogger("pagedllm")
R = TypeVar("R")

# Test hook, fault injection (never set it in production): with PAGEDLLM_TEST_FAULTS=1 in the
# engine core's environment, a request whose cache_salt is "fault:<stage>" fails at that stage:
# "sample" (every sampling call that includes it raises), "logits" (its logits row becomes NaN)
# or "token" (it samples the id just past the vocabulary). Read when the runner is built.
FAULT_ENV = "PAGEDLLM_TEST_FAULTS"
# Faults of the process, not of any request: isolating them per request would only hide them.
_FATAL = (MemoryError, torch.OutOfMemoryError)


def _constraint_field(request: Request) -> str:
    """The first field of ``request`` that can leave no token to sample, for its error's ``param``."""
    params = request.sampling_params
    for name in ("allowed_token_ids", "bad_words", "structured_outputs", "logit_bias"):
        if getattr(params, name):
            return name
    return "min_tokens" if params.min_tokens else "repetition_penalty"


class InjectedFault(RuntimeError):
    """Raised by the fault-injection test hook."""


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
        tp: this rank's tensor-parallel group; rank 0 (the driver) schedules' steps are
            broadcast to the others (:meth:`execute`), which run them (:meth:`execute_remote`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        kv: KVCacheConfig,
        tp: TPGroup = SINGLE,
    ) -> None:
        self.model = model
        self.tp = tp
        # Rank 0 sends each step to the others; they keep the block tables it sent.
        self.mirror = BlockTableMirror() if tp.size > 1 and tp.is_driver else None
        self.tables: dict[str, list[list[int]]] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StepInput)
        self.config = config
        self.block_size = kv.block_size
        self.groups = kv.groups
        self.kv_caches = allocate_kv_caches(kv)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.inject_faults = os.environ.get(FAULT_ENV) == "1"

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on the driver rank: forward pass, logits, sampling (see the module docstring)."""
        # Decodes first: the attention batches them in one call.
        order = sorted(range(len(sched.scheduled)), key=lambda i: sched.scheduled[i].num_new_tokens != 1)
        reqs = [sched.scheduled[i] for i in order]

        token_ids: list[int] = []
        positions: list[int] = []
        # Hidden rows that need logits, in one lm_head call: sampled rows first (their logits are
        # then a view), then each verified request's 1 + k rows, then prompt-logprob rows.
        sample_rows: list[tuple[int, ScheduledRequest]] = []
        sample_idx: list[int] = []
        verify_rows: list[tuple[int, ScheduledRequest, int]] = []  # (index, request, first logits row)
        verify_idx: list[int] = []
        prompt_rows: list[tuple[int, ScheduledRequest, int, int]] = []  # (index, request, first row, rows)
        prompt_idx: list[int] = []
        for i, s in zip(order, reqs):
            start, end = s.num_computed_before, s.num_computed_before + s.num_new_tokens
            first = len(token_ids)
            token_ids.extend(s.request.all_token_ids[start:end])  # stops at the last known token
            token_ids.extend(s.spec_token_ids)
            positions.extend(range(start, end))
            if s.request.sampling_params.prompt_logprobs is not None:
                # Token p + 1 is predicted from position p, up to the prompt's last token.
                rows = min(end, s.request.num_prompt_tokens - 1) - start
                if rows > 0:
                    prompt_rows.append((i, s, len(prompt_idx), rows))
                    prompt_idx.extend(range(first, first + rows))
            if s.spec_token_ids:
                verify_rows.append((i, s, len(verify_idx)))
                verify_idx.extend(range(len(token_ids) - len(s.spec_token_ids) - 1, len(token_ids)))
            elif s.samples:
                sample_idx.append(len(token_ids) - 1)
                sample_rows.append((i, s))
        logit_rows = sample_idx + verify_idx + prompt_idx
        if self.mirror is not None:
            self.tp.broadcast_bytes(self._encoder.encode(self.mirror.step_input(reqs, logit_rows)))
        hidden = self._forward(
            token_ids, positions, [s.num_new_tokens for s in reqs],
            [s.num_computed_before + s.num_new_tokens for s in reqs], [s.block_ids for s in reqs],
        )
        logits = self.model.compute_logits(hidden[logit_rows]) if logit_rows else None

        n = len(reqs)
        sampled: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[TokenLogprobs | None] = [None] * n
        prompt_logprobs: list[TokenLogprobs | None] = [None] * n
        errors: dict[int, str] = {}
        if logits is None:
            return ModelRunnerOutput(sampled, logprobs, prompt_logprobs, errors)

        base = len(sample_idx) + len(verify_idx)
        for i, s, first, rows in prompt_rows:
            try:
                prompt_logprobs[i] = self._prompt_logprobs(s, logits[base + first : base + first + rows])
            except _FATAL:
                raise
            except Exception as e:
                errors[i] = self._failed(s.request, "prompt logprobs", e)
        # A request whose prompt logprobs failed samples nothing this step.
        sample_keep = [j for j, (i, _) in enumerate(sample_rows) if i not in errors]
        verify_rows = [v for v in verify_rows if v[0] not in errors]
        if verify_rows:
            verify_logits = logits[len(sample_idx) : base]
            results = self._isolated(
                lambda js: self._verify(verify_logits, [verify_rows[j] for j in js]),
                [(i, s.request) for i, s, _ in verify_rows], errors, "verification",
            )
            for (i, _, _), result in zip(verify_rows, results):
                if result is not None:
                    sampled[i], logprobs[i] = result
        if sample_keep:
            sample_logits = logits[: len(sample_idx)]
            if len(sample_keep) < len(sample_rows):
                sample_logits = sample_logits[sample_keep]
            for i, result in self._sample_rows(sample_logits, [sample_rows[j] for j in sample_keep], errors).items():
                sampled[i], logprobs[i] = result
        for i, tokens in enumerate(sampled):
            # A token id the embedding cannot look up would crash the next step for everyone.
            bad = [t for t in tokens if not 0 <= t < self.config.vocab_size]
            if bad:
                errors[i] = RequestError(f"sampled token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
                logger.error("request %s: %s", sched.scheduled[i].request.request_id, errors[i].message)
                sampled[i], logprobs[i] = [], None
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs, errors)

    @torch.inference_mode()
    def execute_remote(self) -> bool:
        """Run one step on a non-driver rank, as broadcast by rank 0; False when told to stop."""
        step = self._decoder.decode(self.tp.broadcast_bytes(None))
        if step.shutdown:
            return False
        apply_updates(self.tables, step, len(self.groups))
        token_ids = [t for r in step.requests for t in r.token_ids]
        positions = [p for r in step.requests for p in range(r.num_computed_before, r.num_computed_before + len(r.token_ids))]
        hidden = self._forward(
            token_ids, positions, [len(r.token_ids) for r in step.requests],
            [r.num_computed_before + len(r.token_ids) for r in step.requests],
            [self.tables[r.req_id] for r in step.requests],
        )
        if step.logit_rows:
            self.model.compute_logits(hidden[step.logit_rows])  # this rank's vocabulary share, gathered on rank 0
        return True

    def stop_remote(self) -> None:
        """Tell the other ranks to leave their loops (driver only)."""
        if self.mirror is not None:
            self.tp.broadcast_bytes(self._encoder.encode(StepInput(shutdown=True)))

    def _forward(
        self,
        token_ids: list[int],
        positions: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[list[int]]],
    ) -> torch.Tensor:
        """The model over the step's flattened tokens: [T, hidden_size] final hidden states."""
        meta = build_attention_metadata(
            self.groups, self.config.num_layers, query_lens, seq_lens, block_tables, self.block_size
        )
        return self.model(
            torch.tensor(token_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            self.kv_caches,
            meta,
        )

    def _sample_rows(
        self, logits: torch.Tensor, sample_rows: list[tuple[int, ScheduledRequest]], errors: dict[int, str]
    ) -> dict[int, tuple[list[int], TokenLogprobs | None]]:
        """Sample the next token of each request from its raw logits row ([B, V] float32).

        Returns:
            Output index -> (one token, its logprobs or None), for the requests that did not
            fail; those that did are in ``errors``.
        """
        if self.inject_faults:
            for j, (_, s) in enumerate(sample_rows):
                if _marked(s.request, "logits"):
                    logits[j] = float("nan")
        # NaN beats every value in argmax and poisons a softmax: nothing sampled from such a
        # row means anything. Raw logits are finite unless something broke.
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        if not all(finite):
            for j, (i, s) in enumerate(sample_rows):
                if not finite[j]:
                    errors[i] = RequestError(f"the model produced non-finite logits for request {s.request.request_id}")
                    logger.error("%s", errors[i].message)
            keep = [j for j, ok in enumerate(finite) if ok]
            logits, sample_rows = logits[keep], [sample_rows[j] for j in keep]
        if not sample_rows:
            return {}
        results = self._isolated(
            lambda js: self._sample(logits[js], [sample_rows[j][1] for j in js]),
            [(i, s.request) for i, s in sample_rows], errors, "sampling",
        )
        return {i: result for (i, _), result in zip(sample_rows, results) if result is not None}

    def _isolated(
        self,
        run: Callable[[list[int]], list[R]],
        requests: list[tuple[int, Request]],
        errors: dict[int, str],
        stage: str,
    ) -> list[R | None]:
        """``run`` over all of ``requests`` at once; if that raises, over each alone.

        Args:
            run: maps positions in ``requests`` to one result per position; raises on failure.
            requests: (output index, request) per position.
            errors: filled with the output index -> message of each request that fails alone.
            stage: what ``run`` does, for messages.

        Returns:
            One result per position, None where the request failed.
        """
        # A batch that raised may have drawn from seeded generators: rewind them so a retried
        # request samples what it would have sampled in a healthy batch.
        states = [(r.generator, r.generator.get_state()) for _, r in requests if r.generator is not None]
        try:
            return list(run(list(range(len(requests)))))
        except _FATAL:
            raise
        except Exception:
            logger.warning("batched %s of %d requests failed; retrying one by one", stage, len(requests))
        for generator, state in states:
            generator.set_state(state)
        results: list[R | None] = []
        for j, (i, request) in enumerate(requests):
            try:
                results.extend(run([j]))
            except _FATAL:
                raise
            except Exception as e:
                errors[i] = self._failed(request, stage, e)
                results.append(None)
        return results

    @staticmethod
    def _failed(request: Request, stage: str, error: Exception) -> RequestError:
        if isinstance(error, InvalidParamError):  # the request's own input: no traceback
            logger.warning("request %s failed in %s: %s", request.request_id, stage, error)
            return RequestError.of(error)
        logger.error("request %s failed in %s", request.request_id, stage, exc_info=error)
        return RequestError(f"{stage} failed: {type(error).__name__}: {error}")

    def _sample(
        self, logits: torch.Tensor, reqs: list[ScheduledRequest]
    ) -> list[tuple[list[int], TokenLogprobs | None]]:
        """Sample one token per row of ``logits`` ([B, V] float, raw) and its logprobs if asked."""
        if self.inject_faults and any(_marked(s.request, "sample") for s in reqs):
            raise InjectedFault("injected sampling fault")
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
            meta = replace(meta, grammar_mask=(fill_bitmask(grammars, logits.shape[1]), constrained))
            if any(g.matcher.is_error() for g in grammars):  # fails this batch; ``_isolated`` retries each alone
                error = next(g.matcher.get_error() for g in grammars if g.matcher.is_error())
                raise InvalidParamError("structured_outputs", f"the grammar failed while generating: {short_error(error)}")
        out = self.sampler(logits, meta)
        if out.unsamplable:  # fails this batch; ``_isolated`` retries each request alone
            raise InvalidParamError(
                _constraint_field(reqs[0].request),
                "no token can be sampled: the request's allowed_token_ids, bad_words, structured output, "
                "min_tokens and penalties leave no token with a finite logit",
            )
        tokens = out.sampled_token_ids.tolist()
        results: list[tuple[list[int], TokenLogprobs | None]] = []
        for j, s in enumerate(reqs):
            if self.inject_faults and _marked(s.request, "token"):
                tokens[j] = self.config.vocab_size
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
        if self.inject_faults and any(_marked(s.request, "sample") for _, s, _ in verify_rows):
            raise InjectedFault("injected verification fault")
        logits = all_logits[idx]
        if self.inject_faults:
            row = 0
            for _, s, _ in verify_rows:
                if _marked(s.request, "logits"):
                    logits[row] = float("nan")
                row += len(s.spec_token_ids) + 1
        if not torch.isfinite(logits).all():
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
            if self.inject_faults and _marked(s.request, "token"):
                tokens = [*tokens[:-1], self.config.vocab_size]
            lp = None
            num = s.request.sampling_params.logprobs
            if num is not None:  # raw logprobs of each emitted token, at its own position
                ids, lps, ranks = compute_logprobs(
                    logits[row : row + len(tokens)], torch.tensor(tokens, dtype=torch.long), num
                )
                lp = TokenLogprobs(ids.tolist(), lps.tolist(), ranks.tolist())
            results.append((tokens, lp))
            row += len(s.spec_token_ids) + 1
        return results

    @staticmethod
    def _prompt_logprobs(s: ScheduledRequest, logits: torch.Tensor) -> TokenLogprobs:
        """Log-probabilities of the prompt tokens this chunk predicts (token p+1 from position p).

        Args:
            logits: [R, V] float32 raw logits of the chunk's first R positions, R > 0.
        """
        request = s.request
        start = s.num_computed_before
        end = start + logits.shape[0]
        targets = torch.tensor(request.prompt_token_ids[start + 1 : end + 1], dtype=torch.long)
        top_ids, top_lps, ranks = compute_logprobs(logits, targets, request.sampling_params.prompt_logprobs)
        return TokenLogprobs(top_ids.tolist(), top_lps.tolist(), ranks.tolist())


def _with_grammar_masks(meta: SamplingMetadata, reqs: list[ScheduledRequest], vocab_size: int) -> SamplingMetadata:
    """``meta`` of a verification batch with the grammar masks of its constrained requests.

    Request b owns k_b + 1 consecutive rows; the mask at draft position i is the grammar's
    after drafts 0..i-1 (all allowed: the engine cut the drafts to the grammar's valid prefix).
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


def _marked(request: Request, stage: str) -> bool:
    """Whether the fault-injection test hook targets this request at this stage."""
    return request.cache_salt == f"fault:{stage}"
