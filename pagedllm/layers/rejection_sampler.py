"""Verifies draft tokens against the target model so the output keeps the target's distribution.

Speculative sampling: Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", §2.3 and Algorithm 1 (correctness: Appendix A.1); Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2 and
Theorem 1 ("modified rejection sampling"). For a request with drafts x_1..x_k drawn from
q_1..q_k and target distributions p_1..p_{k+1} (one forward pass over the last token and the
drafts):

- draft x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order;
- at the first rejection, one token is drawn from norm(max(p_i - q_i, 0)) and the rest dropped;
- if all k are accepted, a bonus token is drawn from p_{k+1}.

Each emitted token is then distributed exactly as p given the tokens before it. A proposer
that gives no q (n-gram lookup) proposes x_i with certainty: q_i is one-hot, so x_i is kept
with probability p_i(x_i) and the residual is p_i with x_i removed.

p is the distribution the normal sampler draws from: penalties and the ``min_tokens`` mask
computed with the drafts before position i counted as output, then temperature, top-k, top-p,
min-p (``sampler.process_logits`` and ``sampler.sampling_probs``). Greedy requests keep a
draft only if it equals the argmax, and emit the argmax at the first mismatch, so their
output is the same token for token as without speculation.
"""

from __future__ import annotations

import torch

from pagedllm.layers.sampler import in_this_thread, inverse_cdf, process_logits, sampling_probs
from pagedllm.layers.sampling_metadata import SamplingMetadata


class RejectionSampler(torch.nn.Module):
    """Accepts or rejects each request's drafts and samples its next token (see module docstring)."""

    def forward(
        self,
        logits: torch.Tensor,
        meta: SamplingMetadata,
        draft_token_ids: list[list[int]],
        draft_probs: list[torch.Tensor | None],
        generators: list[torch.Generator | None],
    ) -> list[list[int]]:
        """Verify B requests' drafts.

        Args:
            logits: FloatTensor[N, V], raw target logits; request b owns k_b + 1 consecutive
                rows (its k_b draft positions, then the bonus position), N = sum(k_b + 1).
            meta: built from one ``SamplingRow`` per row of ``logits``; row i of request b
                counts drafts 0..i-1 as output tokens (for penalties and ``min_tokens``).
            draft_token_ids: per request, its k_b >= 1 drafts.
            draft_probs: per request, FloatTensor[k_b, V], the distribution each draft was
                drawn from; None for drafts proposed with certainty (one-hot q).
            generators: per request, its seeded CPU generator or None (global generator).

        Returns:
            Per request, its accepted drafts followed by one sampled token (1 to k_b + 1 ids).
        """
        processed = process_logits(logits, meta)
        starts, start = [], 0
        for drafts in draft_token_ids:
            starts.append(start)
            start += len(drafts) + 1

        random_rows = range(len(logits)) if meta.random_rows is None else meta.random_rows.tolist()
        p_index = {row: j for j, row in enumerate(random_rows)}  # logits row -> row of p
        result: list[list[int]] = [[] for _ in draft_token_ids]
        randoms = [b for b, s in enumerate(starts) if s in p_index]
        greedy = [b for b, s in enumerate(starts) if s not in p_index]
        if greedy:
            self._verify_greedy(processed, greedy, starts, draft_token_ids, result)
        if randoms:
            p = sampling_probs(processed, meta)
            self._verify_random(p, p_index, randoms, starts, draft_token_ids, draft_probs, generators, result)
        return result

    @staticmethod
    def _verify_greedy(
        processed: torch.Tensor,
        requests: list[int],
        starts: list[int],
        draft_token_ids: list[list[int]],
        result: list[list[int]],
    ) -> None:
        """Keep drafts while they equal the argmax; then emit the argmax (first index on ties)."""
        rows = [starts[b] + i for b in requests for i in range(len(draft_token_ids[b]) + 1)]
        # The first index of the largest logit, as the normal sampler takes argmax; in numpy,
        # in this thread, for float32 on the CPU (sampler.in_this_thread).
        if in_this_thread(processed):
            targets = processed.numpy()[rows].argmax(axis=-1).tolist()
        else:
            targets = processed[rows].max(dim=-1).indices.tolist()
        offset = 0
        for b in requests:
            drafts = draft_token_ids[b]
            n = 0
            while n < len(drafts) and drafts[n] == targets[offset + n]:
                n += 1
            result[b] = drafts[:n] + [targets[offset + n]]
            offset += len(drafts) + 1

    @staticmethod
    def _verify_random(
        p: torch.Tensor,
        p_index: dict[int, int],
        requests: list[int],
        starts: list[int],
        draft_token_ids: list[list[int]],
        draft_probs: list[torch.Tensor | None],
        generators: list[torch.Generator | None],
        result: list[list[int]],
    ) -> None:
        """Leviathan et al. Algorithm 1 for the sampling requests; ``p`` is FloatTensor[R, V]."""
        # Acceptance probabilities min(1, p(x) / q(x)) of every draft, in one gather.
        draft_rows, tokens, q_of_draft = [], [], []
        for b in requests:
            drafts, q = draft_token_ids[b], draft_probs[b]
            draft_rows.extend(p_index[starts[b] + i] for i in range(len(drafts)))
            tokens.extend(drafts)
            ids = torch.tensor(drafts, dtype=torch.long)
            q_of_draft.append(torch.ones(len(drafts)) if q is None else q[torch.arange(len(drafts)), ids])
        p_of_draft = p[torch.tensor(draft_rows), torch.tensor(tokens)]
        accept_prob = (p_of_draft / torch.cat(q_of_draft)).clamp(max=1.0).tolist()

        # k + 1 uniforms per request: one per draft, one for the final draw. Seeded requests
        # draw from their own generator only; the others share one call to the global one.
        num_unseeded = sum(len(draft_token_ids[b]) + 1 for b in requests if generators[b] is None)
        shared = torch.rand(num_unseeded).tolist()
        final_rows, final_u, rejected = [], [], []  # per request, in ``requests`` order
        offset = shared_offset = 0
        for b in requests:
            drafts = draft_token_ids[b]
            k = len(drafts)
            if generators[b] is None:
                u = shared[shared_offset : shared_offset + k + 1]
                shared_offset += k + 1
            else:
                u = torch.rand(k + 1, generator=generators[b]).tolist()
            n = 0
            while n < k and u[n] < accept_prob[offset + n]:  # u in [0, 1): P(accept) = accept_prob
                n += 1
            offset += k
            result[b] = drafts[:n]
            final_rows.append(p_index[starts[b] + n])
            final_u.append(1.0 - u[k])  # (0, 1], as the inverse CDF wants
            rejected.append(n if n < k else None)

        final = p[final_rows]  # a copy: p itself stays intact for the fallback below
        for j, b in enumerate(requests):
            n = rejected[j]
            if n is None:
                continue  # bonus token: draw from p_{k+1} as it is
            q = draft_probs[b]
            if q is None:
                final[j, draft_token_ids[b][n]] = 0.0
            else:
                final[j] = (final[j] - q[n]).clamp_(min=0.0)
        # max(p - q, 0) sums to 0 only when p == q, where rejection has probability 0; float
        # rounding can still reject there, and then p itself is the right distribution.
        empty = final.sum(dim=-1) <= 0.0
        if bool(empty.any()):
            final[empty] = p[torch.tensor(final_rows)[empty]]
        sampled = inverse_cdf(final, torch.tensor(final_u).unsqueeze(1)).tolist()
        for j, b in enumerate(requests):
            result[b].append(sampled[j])
