"""Turns a scheduler step into one forward pass over the flattened tokens, then samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import ModelConfig
from pagedllm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.sampler import Sampler, SamplingMetadata, SamplingRow, compute_logprobs
from pagedllm.outputs import TokenLogprobs
from pagedllm.worker.kv_cache import allocate_kv_caches


@dataclass
class ModelRunnerOutput:
    """Per scheduled request, in the scheduler's order."""

    sampled: list[list[int]]  # new token ids; empty for a prefill chunk short of the end
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[TokenLogprobs | None]


class ModelRunner:
    """Owns the model and the KV caches; executes one step at a time.

    Args:
        model: the model (see ``pagedllm.models``), already loaded.
        config: its hyper-parameters.
        num_blocks, block_size: KV cache geometry.
        dtype: dtype of the KV caches (the model's compute dtype).
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
        self.kv_caches = allocate_kv_caches(config, num_blocks, block_size, dtype)
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        # Decodes first: the attention batches them in one call.
        order = sorted(range(len(sched.scheduled)), key=lambda i: sched.scheduled[i].num_new_tokens != 1)
        reqs = [sched.scheduled[i] for i in order]

        token_ids: list[int] = []
        positions: list[int] = []
        for s in reqs:
            start, end = s.num_computed_before, s.num_computed_before + s.num_new_tokens
            token_ids.extend(s.request.all_token_ids[start:end])
            positions.extend(range(start, end))
        meta = AttentionMetadata.build(
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
        for i, s in zip(order, reqs):
            offset += s.num_new_tokens
            if s.request.sampling_params.prompt_logprobs is not None:
                prompt_logprobs[i] = self._prompt_logprobs(s, hidden[offset - s.num_new_tokens : offset])
            if s.samples:
                sample_idx.append(offset - 1)
                sample_rows.append((i, s))
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
