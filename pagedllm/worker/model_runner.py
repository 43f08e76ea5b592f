"""Turns a scheduler step into one forward pass over the flattened tokens, then samples.

A request with draft tokens (speculative decoding) is fed its last token and its drafts; the
logits at all ``1 + k`` positions go to the rejection sampler, which returns the accepted
drafts and one more token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import ModelConfig
from pagedllm.core.kv_cache_groups import kv_cache_groups
from pagedllm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedllm.layers.rejection_sampler import RejectionSampler
from pagedllm.layers.sampler import Sampler, compute_logprobs
from pagedllm.layers.sampling_metadata import SamplingMetadata, SamplingRow
from pagedllm.outputs import TokenLogprobs
from pagedllm.worker.kv_cache import allocate_kv_caches, build_attention_metadata


@dataclass
class ModelRunnerOutput:
    """Per scheduled request, in the scheduler's order."""

    sampled: list[list[int]]  # new token ids (with drafts: the accepted ones, then one sampled); [] mid-prefill
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[TokenLogprobs | None]


class ModelRunner:
    """Owns the model and the KV caches; executes one step at a time.

    Args:
        model: the model (see ``pagedllm.models``), already loaded.
        config: its hyper-parameters.
        num_blocks, block_size: KV cache geometry.
        dtype: dtype of the KV caches.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.groups = kv_cache_groups(config)
        self.kv_caches = allocate_kv_caches(config, num_blocks, block_size, dtype)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        # Decodes first: the attention batches them in one call.
        order = sorted(range(len(sched.scheduled)), key=lambda i: sched.scheduled[i].num_new_tokens != 1)
        reqs = [sched.scheduled[i] for i in order]

        token_ids: list[int] = []
        positions: list[int] = []
        for s in reqs:
            start, end = s.num_computed_before, s.num_computed_before + s.num_new_tokens
            token_ids.extend(s.request.all_token_ids[start:end])  # stops at the last known token
            token_ids.extend(s.spec_token_ids)
            positions.extend(range(start, end))
        meta = build_attention_metadata(
            self.groups,
            self.config.num_layers,
            [s.num_new_tokens for s in reqs],
            [s.num_computed_before + s.num_new_tokens for s in reqs],
            [s.block_ids for s in reqs],
            self.block_size,
        )
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            self.kv_caches,
            meta,
        )

        n = len(reqs)
        sampled: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[TokenLogprobs | None] = [None] * n
        prompt_logprobs: list[TokenLogprobs | None] = [None] * n

        sample_rows, sample_idx, offset = [], [], 0
        verify_rows: list[tuple[int, ScheduledRequest, int]] = []  # (index, request, first row)
        for i, s in zip(order, reqs):
            offset += s.num_new_tokens
            if s.request.sampling_params.prompt_logprobs is not None:
                prompt_logprobs[i] = self._prompt_logprobs(s, hidden[offset - s.num_new_tokens : offset])
            if s.spec_token_ids:
                verify_rows.append((i, s, offset - len(s.spec_token_ids) - 1))
            elif s.samples:
                sample_idx.append(offset - 1)
                sample_rows.append((i, s))
        if verify_rows:
            self._verify(hidden, verify_rows, sampled, logprobs)
        if not sample_rows:
            return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)

        logits = self.model.compute_logits(hidden[sample_idx])
        rows = [
            SamplingRow(
                params=s.request.sampling_params,
                prompt_token_ids=s.request.prompt_token_ids,
                output_token_ids=s.request.output_token_ids,
                generator=s.request.generator,
                eos_token_ids=s.request.eos_token_ids,
            )
            for _, s in sample_rows
        ]
        out = self.sampler(logits, SamplingMetadata.build(rows))
        tokens = out.sampled_token_ids.tolist()
        for j, (i, s) in enumerate(sample_rows):
            sampled[i] = [tokens[j]]
            if out.logprobs is not None and s.request.sampling_params.logprobs is not None:
                num = s.request.sampling_params.logprobs + 1
                logprobs[i] = TokenLogprobs(
                    [out.logprobs.token_ids[j, :num].tolist()],
                    [out.logprobs.logprobs[j, :num].tolist()],
                    [int(out.logprobs.ranks[j])],
                )
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)

    def _verify(
        self,
        hidden: torch.Tensor,
        verify_rows: list[tuple[int, ScheduledRequest, int]],
        sampled: list[list[int]],
        logprobs: list[TokenLogprobs | None],
    ) -> None:
        """Rejection-sample the requests with drafts; fill their ``sampled`` and ``logprobs`` entries.

        Args:
            hidden: [T, hidden_size], the step's final hidden states.
            verify_rows: (output index, request, row in ``hidden`` of its last known token);
                its drafts' rows follow that row.
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
        logits = self.model.compute_logits(hidden[idx])
        accepted = self.rejection_sampler(
            logits,
            SamplingMetadata.build(rows),
            [s.spec_token_ids for _, s, _ in verify_rows],
            [s.spec_probs for _, s, _ in verify_rows],
            [s.request.generator for _, s, _ in verify_rows],
        )
        row = 0
        for (i, s, _), tokens in zip(verify_rows, accepted):
            sampled[i] = tokens
            num = s.request.sampling_params.logprobs
            if num is not None:  # raw logprobs of each emitted token, at its own position
                ids, lps, ranks = compute_logprobs(
                    logits[row : row + len(tokens)], torch.tensor(tokens, dtype=torch.long), num
                )
                logprobs[i] = TokenLogprobs(ids.tolist(), lps.tolist(), ranks.tolist())
            row += len(s.spec_token_ids) + 1

    def _prompt_logprobs(self, s: ScheduledRequest, hidden: torch.Tensor) -> TokenLogprobs | None:
        """Log-probabilities of the prompt tokens this chunk predicts (token p+1 from position p)."""
        request = s.request
        start = s.num_computed_before
        end = min(start + s.num_new_tokens, request.num_prompt_tokens - 1)
        if end <= start:
            return None
        logits = self.model.compute_logits(hidden[: end - start])
        targets = torch.tensor(request.prompt_token_ids[start + 1 : end + 1], dtype=torch.long)
        top_ids, top_lps, ranks = compute_logprobs(logits, targets, request.sampling_params.prompt_logprobs)
        return TokenLogprobs(top_ids.tolist(), top_lps.tolist(), ranks.tolist())
