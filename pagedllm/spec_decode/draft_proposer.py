"""Draft-model proposer: a smaller model with the target's vocabulary drafts k tokens autoregressively.

Leviathan et al. 2023 §2.3 / Chen et al. 2023: the draft model M_q samples x_1..x_k from
q_1..q_k; the target verifies them in one pass (``layers.rejection_sampler``). The draft
model keeps its own paged KV cache (its own ``KVCacheManager`` and blocks, no prefix
caching), one sequence per request, mirroring the request's tokens:

- each step the sequence first catches up: the tokens the request gained since the last
  proposal (its whole prompt the first time; afterwards the accepted drafts' correction or
  bonus token) are fed in one batched forward, which also yields q_1;
- then k - 1 batched single-token steps feed x_1..x_{k-1} and yield q_2..q_k.

The draft K/V of x_i stays valid exactly when the target accepted x_i, so before catching up
the sequence is cut back to its longest prefix that agrees with the request's tokens (the
blocks past it are returned). Drafts are sampled with the request's own sampling parameters
(penalties, temperature, top-k/p, min-p; argmax for greedy requests), which keeps q close to
the target's p; any q is correct since q is handed to the verifier.
"""

from __future__ import annotations

import logging
from collections.abc import Container
from dataclasses import dataclass, field

import torch

from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.layers.sampler import inverse_cdf, process_logits, sampling_probs
from pagedllm.layers.sampling_metadata import SamplingMetadata, SamplingRow
from pagedllm.models.loader import load_model, resolve_model
from pagedllm.spec_decode.proposer import max_num_drafts
from pagedllm.worker.kv_cache import allocate_kv_caches, build_attention_metadata

logger = logging.getLogger("pagedllm")


@dataclass
class _DraftSequence:
    """One request's tokens in the draft cache; ``KVCacheManager`` reads ``request_id`` and
    ``num_computed_tokens`` (and ``num_tokens`` with prefix caching, which is off here)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)  # tokens whose K/V is in the draft cache
    num_known: int = 0  # leading token_ids that are the request's real tokens (the rest are drafts)

    @property
    def num_computed_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class _Drafting:
    """A request being drafted for in this call."""

    request: Request
    seq: _DraftSequence
    num_drafts: int
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # FloatTensor[V] per draft (random requests)


class DraftModelProposer:
    """Runs the draft model for every decoding request.

    Args:
        model: the draft model's path or alias.
        num_speculative_tokens: k.
        vocab_size: the target's vocabulary size (the draft's must equal it).
        num_blocks, block_size: the draft KV cache's geometry (the engine gives it as many
            token slots as the target's cache).
        dtype, kv_dtype: compute dtype and KV cache dtype.
        max_model_len: the engine's longest request (the draft's RoPE as the target's: ``load_model``).

    Raises:
        ValueError: if the draft model cannot be loaded or its vocabulary differs.
    """

    def __init__(
        self,
        model: str,
        num_speculative_tokens: int,
        vocab_size: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        max_model_len: int | None = None,
    ) -> None:
        self.model, self.config = load_model(resolve_model(model), dtype, max_model_len=max_model_len)
        if self.config.vocab_size != vocab_size:
            raise ValueError(
                f"draft model {model!r} has vocabulary size {self.config.vocab_size}, "
                f"the target model {vocab_size}: they must share one vocabulary"
            )
        self.k = num_speculative_tokens
        self.block_size = block_size
        kv = KVCacheConfig.for_model(self.config, num_blocks, block_size, kv_dtype)
        self.groups = kv.groups
        self.kv_cache = KVCacheManager(num_blocks, block_size, enable_caching=False, groups=self.groups)
        self.kv_caches = allocate_kv_caches(kv)
        self.seqs: dict[str, _DraftSequence] = {}
        logger.info(
            "draft model %s: %d layers, KV cache %d blocks", self.config.name or model, self.config.num_layers, num_blocks
        )

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> None:
        """Set ``spec_token_ids`` and ``spec_probs`` of each request (none where it cannot draft)."""
        batch = []
        for request in requests:
            request.spec_token_ids, request.spec_probs = [], None
            # The draft positions fed are num_tokens - 1 + (0 .. k - 2): keep them in the draft's context.
            room = self.config.max_position_embeddings - request.num_tokens + 1
            k = min(max_num_drafts(request, self.k), room)
            if k > 0 and (d := self._catch_up_slots(request, k)) is not None:
                batch.append(d)
        if not batch:
            return

        # Step 1: feed each request's new tokens; the last position's logits give draft 1.
        new = [d.request.all_token_ids[d.seq.num_computed_tokens :] for d in batch]
        self._draft_step(batch, new)
        for d in batch:
            d.seq.num_known = d.request.num_tokens
        # Steps 2..k: feed the previous draft, one token per request.
        for i in range(1, self.k):
            going = [d for d in batch if d.num_drafts > i]
            if not going:
                break
            self._draft_step(going, [[d.drafts[-1]] for d in going])

        for d in batch:
            d.request.spec_token_ids = d.drafts
            d.request.spec_probs = torch.stack(d.probs) if d.probs else None

    def remove_finished(self, live: Container[str]) -> None:
        """Free the draft blocks of requests no longer in ``live``."""
        for request_id in [r for r in self.seqs if r not in live]:
            self.kv_cache.free(self.seqs.pop(request_id))

    def _catch_up_slots(self, request: Request, num_drafts: int) -> _Drafting | None:
        """Cut the request's draft sequence back to what still matches, then make room for the
        tokens to feed (new ones, then num_drafts - 1 drafts). None if the draft cache is full."""
        seq = self.seqs.get(request.request_id)
        if seq is None:
            seq = self.seqs[request.request_id] = _DraftSequence(request.request_id)
        tokens = request.all_token_ids
        valid = seq.num_known  # real tokens never change; drafts after them may have been accepted
        while valid < len(seq.token_ids) and valid < len(tokens) and seq.token_ids[valid] == tokens[valid]:
            valid += 1
        valid = min(valid, len(tokens) - 1)  # feed at least the last token: its logits give draft 1
        del seq.token_ids[valid:]
        seq.num_known = valid
        self.kv_cache.trim(seq, valid)
        if not self.kv_cache.allocate_slots(seq, len(tokens) - valid, num_lookahead_tokens=num_drafts - 1):
            self.kv_cache.free(seq)  # start over later, when there is room
            del self.seqs[request.request_id]
            return None
        return _Drafting(request, seq, num_drafts)

    def _draft_step(self, batch: list[_Drafting], feeds: list[list[int]]) -> None:
        """One forward of the draft model over ``feeds`` (appended to each sequence), then one
        draft per request from the logits at its last fed position."""
        # Requests fed one token are decodes: the attention wants them first.
        order = sorted(range(len(batch)), key=lambda i: len(feeds[i]) != 1)
        batch = [batch[i] for i in order]
        feeds = [feeds[i] for i in order]
        token_ids, positions, last_rows = [], [], []
        for d, feed in zip(batch, feeds):
            start = d.seq.num_computed_tokens
            token_ids.extend(feed)
            positions.extend(range(start, start + len(feed)))
            last_rows.append(len(token_ids) - 1)
        meta = build_attention_metadata(
            self.groups,
            self.config.num_layers,
            [len(f) for f in feeds],
            [d.seq.num_computed_tokens + len(f) for d, f in zip(batch, feeds)],
            [self.kv_cache.block_ids(d.seq.request_id) for d in batch],
            self.block_size,
        )
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), self.kv_caches, meta
        )
        for d, feed in zip(batch, feeds):
            d.seq.token_ids.extend(feed)
        self._sample(batch, self.model.compute_logits(hidden[last_rows]))

    @staticmethod
    def _sample(batch: list[_Drafting], logits: torch.Tensor) -> None:
        """Append one draft per request, drawn from its processed draft distribution q.

        Args:
            logits: FloatTensor[B, V], the draft model's logits at each request's last position.
        """
        rows = [
            SamplingRow(
                params=d.request.sampling_params,
                prompt_token_ids=d.request.prompt_token_ids,
                output_token_ids=d.request.output_token_ids + d.drafts,
                eos_token_ids=d.request.eos_token_ids,
            )
            for d in batch
        ]
        meta = SamplingMetadata.build(rows)
        processed = process_logits(logits, meta)
        tokens = processed.max(dim=-1).indices.tolist()  # greedy requests keep these
        if not meta.all_greedy:
            q = sampling_probs(processed, meta)
            random_rows = range(len(batch)) if meta.random_rows is None else meta.random_rows.tolist()
            u = [torch.rand(1, generator=batch[i].request.generator) for i in random_rows]
            drawn = inverse_cdf(q.clone(), 1.0 - torch.cat(u).unsqueeze(1)).tolist()
            for j, i in enumerate(random_rows):
                tokens[i] = drawn[j]
                batch[i].probs.append(q[j])
        for d, token in zip(batch, tokens):
            d.drafts.append(token)
