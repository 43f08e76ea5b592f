"""Turns one engine step's logits into next tokens, with vLLM's sampling semantics.

Pipeline per step, each stage skipped when no row of the batch uses it (vLLM's order):

1. the grammar mask of structured-output rows (-inf for every token the grammar forbids),
   ``allowed_token_ids`` (all other tokens -inf), ``bad_words`` (-inf for a token that would
   complete one), ``logit_bias`` (added to the logits), each one sparse update for the batch;
2. penalties (repetition on prompt + output tokens, presence and frequency on output tokens);
3. ``min_tokens``: EOS and stop token ids masked while the output is still too short;
4. greedy rows (temperature 0) take the argmax;
5. the other rows: temperature -> min-p -> top-k -> top-p -> one draw (inverse CDF), vLLM V1's
   order: with min-p and top-p together the nucleus is top_p of the mass min-p keeps.

Logprobs are those of the raw model distribution (vLLM's default ``raw_logprobs``): the
log-softmax of the logits as the model produced them, before any of the stages above.

On the CPU, full-vocabulary sorts and per-token random numbers would cost more than
everything else (docs/benchmarks.md), so the sampler uses neither:
each sampling row draws one uniform (inverse CDF), and top-k / top-p rows draw among their
few most likely tokens. Stage 5 is one native call for all rows where the kernels run
(``RowDraw``: the tokens near each row's maximum, selected by weight without a sort), else
tensor ops with ``topk`` candidates (a full sort only for extremely flat rows). Logprobs are
one native call too (``RowLogprobs``).
Tensors may live on any device; seeded generators are CPU ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.kernels import elementwise, library, penalties, sampling
from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.logprobs import LogprobsTensors, RowLogprobs, largest
from pagedllm.layers.sampling_metadata import PenaltyTensors, SamplingMetadata, TruncationTensors
from pagedllm.structured_output.bitmask import apply_bitmask

# Top-p first looks for the nucleus among this many most likely tokens, then among 4x as
# many for the rows whose nucleus is wider, and so on; only very flat rows reach a full sort.
_FIRST_CANDIDATES = 64
_CANDIDATE_GROWTH = 4


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """sampled_token_ids: LongTensor[S]; logprobs: None unless some row asked for them.

    ``unsamplable``: the rows left with no token to sample (``unsamplable_rows``); each still
    has a valid id in ``sampled_token_ids``, but not one its request allows.
    """

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None
    unsamplable: list[int] = field(default_factory=list)


class Sampler(torch.nn.Module):
    """Samples one token per row of a step's logits; the module docstring gives the pipeline."""

    def __init__(self) -> None:
        super().__init__()
        self.argmax = RowArgmax()
        self.draw = RowDraw()
        self.logprobs = RowLogprobs()

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample from ``logits`` (FloatTensor[S, V], float32, left unmodified)."""
        processed = process_logits(logits, meta)
        sampled = self.argmax(processed) if meta.all_greedy else _sample(processed, meta, self.argmax, self.draw)
        scored = None
        if meta.max_num_logprobs is not None:  # of ``logits``: the model's own distribution
            scored = self.logprobs(logits, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled, scored, unsamplable_rows(logits, processed))


class RowArgmax(CustomOp):
    """LongTensor[S]: the first index of each row's maximum of logits [S, V], as ``argmax``
    gives it. Native: one pass over float32 rows, faster than torch's reduction; PyTorch:
    ``max(dim).indices``, argmax's result and faster than argmax on the CPU (figures for both:
    docs/benchmarks.md)."""

    def forward_native(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.max(dim=-1).indices

    def forward_cpu(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dtype != torch.float32:  # the kernel reads float32 logits
            return self.forward_native(logits)
        return elementwise.argmax_rows(logits.contiguous())


def unsamplable_rows(logits: torch.Tensor, processed: torch.Tensor) -> list[int]:
    """The rows of ``processed`` (``process_logits`` of ``logits``) without a finite largest logit.

    A row whose every token is banned (``allowed_token_ids`` that are all EOS or stop tokens
    while ``min_tokens`` masks them, or all covered by ``bad_words``) is all -inf, and extreme
    penalties overflow to +inf or NaN: nothing sampled from such a row honours the request
    (argmax of an all -inf row is token 0, a banned one).
    """
    if processed is logits:
        return []  # no stage ran; the runner has checked the raw logits
    if in_this_thread(processed):
        return np.flatnonzero(~np.isfinite(processed.numpy().max(axis=-1))).tolist()  # NaN propagates
    top = processed.amax(dim=-1)  # NaN propagates
    return (~torch.isfinite(top)).nonzero().flatten().tolist()


def in_this_thread(logits: torch.Tensor) -> bool:
    """Whether a whole-tensor pass over ``logits`` runs in numpy, in the calling thread: float32
    on the CPU. Torch would split a pass this small across its thread team, and on busy cores
    waiting for the team to wake costs more than the pass itself."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Stages 1-3: token controls, penalties and the ``min_tokens`` mask, on a copy
    (FloatTensor[S, V]).

    ``logits`` itself is returned when no row uses any; it is never modified.
    """
    if (
        meta.grammar_mask is None
        and meta.allowed_tokens is None
        and meta.bad_words_mask is None
        and meta.logit_bias is None
        and meta.penalties is None
        and meta.min_tokens_mask is None
    ):
        return logits
    logits = torch.from_numpy(logits.numpy().copy()) if in_this_thread(logits) else logits.clone()
    if meta.grammar_mask is not None:
        apply_bitmask(logits, *meta.grammar_mask)
    if meta.allowed_tokens is not None:
        kept = logits[meta.allowed_tokens.kept]
        logits[meta.allowed_tokens.rows] = -torch.inf
        logits[meta.allowed_tokens.kept] = kept
    if meta.bad_words_mask is not None:
        logits.index_put_(meta.bad_words_mask, logits.new_tensor(-torch.inf))
    if meta.logit_bias is not None:
        logits.index_put_(meta.logit_bias.index, meta.logit_bias.values, accumulate=True)
    if meta.penalties is not None:
        _apply_penalties(logits, meta.penalties)
    if meta.min_tokens_mask is not None:
        logits.index_put_(meta.min_tokens_mask, logits.new_tensor(-torch.inf))
    return logits


def sampling_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution each sampling row draws from, as a full FloatTensor[R, V].

    Stage 5 without the draw: temperature, min-p, top-k and top-p applied to
    ``process_logits`` output, renormalized. ``Sampler`` draws from exactly this
    distribution without materializing it; speculative decoding's rejection sampler needs it
    whole (its target distribution p). Rows are ``meta.random_rows`` (all rows when None).
    """
    x = logits if meta.random_rows is None else logits[meta.random_rows]
    if meta.temperature is not None:
        x = x / meta.temperature
    probs = x.softmax(dim=-1)
    if meta.min_p is not None:
        probs = _min_p(probs, meta.min_p)
    if meta.truncation is not None:
        probs[meta.truncation.rows] = _truncated_probs(probs, meta.truncation)
    return probs / probs.sum(dim=-1, keepdim=True)


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``probs`` [R, V] (overwritten) with each p < min_p * max p of its row zeroed, renormalized.

    Min-p (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling for Creative and Coherent
    LLM Outputs", §3), before top-k / top-p as in vLLM V1, so that top-p's nucleus is top_p of
    the mass min-p keeps. The most likely token is always kept; ``min_p`` is FloatTensor[R, 1]
    (0: off for that row, whose probabilities are left as they are, bit for bit).
    """
    probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs.div_(torch.where(min_p > 0, probs.sum(dim=-1, keepdim=True), 1.0))


def _truncated_probs(probs: torch.Tensor, trunc: TruncationTensors) -> torch.Tensor:
    """FloatTensor[T, V]: the ``trunc.rows`` of ``probs`` [R, V] with all but their top-k / top-p
    nucleus zeroed (not renormalized); the same candidate search as ``_draw_truncated``."""
    vocab = probs.shape[1]
    out = torch.zeros(len(trunc.rows), vocab, dtype=probs.dtype, device=probs.device)
    pending = torch.arange(len(trunc.rows), device=probs.device)  # indices into trunc.rows
    k = min(vocab, max(trunc.max_top_k, _FIRST_CANDIDATES))
    while True:
        top, top_ids = largest(probs[trunc.rows[pending]], k)
        num_kept, complete = _nucleus_size(top, trunc.top_k[pending], trunc.top_p[pending])
        kept = torch.arange(k, device=top.device) < num_kept
        if k == vocab:
            complete = torch.ones_like(complete)
        done = pending[complete]
        out[done] = out[done].scatter_(1, top_ids[complete], (top * kept)[complete])
        pending = pending[~complete]
        if not len(pending):
            return out
        k = min(vocab, k * _CANDIDATE_GROWTH)


def _apply_penalties(logits: torch.Tensor, pen: PenaltyTensors) -> None:
    """Penalize ``logits`` [S, V] in place.

    Repetition (Keskar et al. 2019, "CTRL", §4.1, as vLLM applies it): a logit of a token in
    the prompt or output is divided by the penalty if positive and multiplied by it otherwise.
    Then presence and frequency (OpenAI's definition): subtract ``frequency * count`` and
    ``presence`` from the logit of each token that occurs ``count > 0`` times in the output.
    Native (one walk of each row's history, ``kernels.penalties``) for float32 CPU logits with
    unit column stride where the kernels run; else sparse gathers and scatters in PyTorch.
    """
    if in_this_thread(logits) and logits.stride(-1) == 1 and library.available():
        penalties.apply_penalties(
            logits, pen.rows, pen.tokens, pen.offsets, pen.num_prompt, pen.repetition, pen.presence, pen.frequency
        )
        return
    lengths = pen.offsets.diff()
    owner = torch.arange(len(pen.rows), device=logits.device).repeat_interleave(lengths)  # index into pen.rows
    tokens = pen.tokens.long()
    prompt_end = pen.offsets[:-1] + pen.num_prompt
    in_output = torch.arange(len(tokens), device=logits.device) >= prompt_end[owner]
    repeating = pen.repetition[owner] != 1.0
    seen = (pen.rows[owner[repeating]], tokens[repeating])  # repeats are harmless: same value written
    values, factor = logits[seen], pen.repetition[owner[repeating]]
    logits[seen] = torch.where(values > 0, values / factor, values * factor)
    # One int64 key per (row, token) output pair: a 1-D unique, far faster than unique(dim=1).
    keys, counts = torch.unique(owner[in_output] << 32 | tokens[in_output], return_counts=True)
    index = (pen.rows[keys >> 32], keys & 0xFFFFFFFF)
    logits[index] = logits[index] - pen.frequency[keys >> 32] * counts - pen.presence[keys >> 32]


def _sample(logits: torch.Tensor, meta: SamplingMetadata, argmax: RowArgmax, draw: RowDraw) -> torch.Tensor:
    """LongTensor[S]: greedy rows take the argmax, the others draw from their distribution."""
    x = logits if meta.random_rows is None else logits[meta.random_rows]
    tokens = draw(x, meta)
    if meta.random_rows is None:
        return tokens
    sampled = torch.empty(len(logits), dtype=torch.long, device=logits.device)
    sampled[meta.random_rows] = tokens
    sampled[meta.greedy_rows] = argmax(logits[meta.greedy_rows])
    return sampled


class RowDraw(CustomOp):
    """LongTensor[R]: one token per row of x [R, V] (the sampling rows' processed logits),
    drawn from its distribution (temperature -> min-p -> top-k -> top-p) at one uniform per
    row (``_uniforms``, seeded rows from their own generator). Rows with top-k or top-p draw
    among their kept tokens most likely first, the others in vocabulary order (inverse CDF).
    Native: every stage of a row in one call (``kernels.sampling``); PyTorch: the stages as
    tensor ops, with ``topk`` candidates instead of a vocabulary sort."""

    def forward_native(self, x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.temperature is not None:
            x = x / meta.temperature
        probs = x.softmax(dim=-1)
        u = _uniforms(len(probs), meta.generators, probs.device)
        if meta.min_p is not None:
            probs = _min_p(probs, meta.min_p)
        trunc = meta.truncation
        if trunc is None:
            return inverse_cdf(probs, u)
        tokens = torch.empty(len(probs), dtype=torch.long, device=probs.device)
        tokens[trunc.rows] = _draw_truncated(probs, trunc, u)
        if len(other := trunc.other_rows):
            tokens[other] = inverse_cdf(probs[other], u[other])
        return tokens

    def forward_cpu(self, x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1:
            return self.forward_native(x, meta)
        rows = len(x)
        u = _uniforms(rows, meta.generators, x.device).view(rows)
        temperature = torch.ones(rows) if meta.temperature is None else meta.temperature.view(rows)
        trunc = meta.truncation
        if trunc is not None and len(trunc.rows) == rows:  # the kernel reads their "off" values as off
            top_k, top_p = trunc.top_k.view(rows), trunc.top_p.view(rows)
        else:
            top_k, top_p = torch.zeros(rows, dtype=torch.long), torch.ones(rows)
            if trunc is not None:
                top_k[trunc.rows] = trunc.top_k.view(-1)
                top_p[trunc.rows] = trunc.top_p.view(-1)
        min_p = torch.zeros(rows) if meta.min_p is None else meta.min_p.view(rows)
        return sampling.sample_rows(x, temperature, top_k, top_p, min_p, u)


def _draw_truncated(probs: torch.Tensor, trunc: TruncationTensors, u: torch.Tensor) -> torch.Tensor:
    """LongTensor[T]: one token for each of the ``trunc.rows`` of ``probs`` [R, V].

    Top-k and top-p keep a most-likely-first prefix of the tokens, so each row draws from
    its K most likely tokens (``topk``, no vocabulary sort), K growing only for the rows
    whose top-p nucleus reaches past them.
    """
    vocab = probs.shape[1]
    tokens = torch.empty(len(trunc.rows), dtype=torch.long, device=probs.device)
    pending = torch.arange(len(trunc.rows), device=probs.device)  # indices into trunc.rows
    k = min(vocab, max(trunc.max_top_k, _FIRST_CANDIDATES))
    while True:
        rows = trunc.rows[pending]
        top, top_ids = largest(probs if len(rows) == len(probs) else probs[rows], k)
        num_kept, complete = _nucleus_size(top, trunc.top_k[pending], trunc.top_p[pending])
        kept = torch.arange(k, device=top.device) < num_kept
        chosen = top_ids.gather(1, inverse_cdf(top * kept, u[rows]).unsqueeze(1)).squeeze(1)
        if k == vocab or bool(complete.all()):
            tokens[pending] = chosen
            return tokens
        tokens[pending[complete]] = chosen[complete]
        pending = pending[~complete]
        k = min(vocab, k * _CANDIDATE_GROWTH)


def _nucleus_size(
    top: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of the candidates top-k then top-p keep.

    Top-k (Fan et al. 2018, "Hierarchical Neural Story Generation", §5.4) keeps the k most
    likely tokens. Top-p (Holtzman et al. 2019, "The Curious Case of Neural Text
    Degeneration", §3.1) keeps the smallest most-likely-first prefix whose mass reaches p,
    i.e. each token whose more likely tokens hold less than p; as in vLLM and HF, it acts
    on the top-k distribution renormalized.

    Args:
        top: FloatTensor[R, K], each row's K largest probabilities, in descending order.
        top_k: LongTensor[R, 1] (larger than V: off); top_p: FloatTensor[R, 1] (``inf``: off).

    Returns:
        LongTensor[R, 1], the number of candidates kept (>= 1), and BoolTensor[R], whether
        the kept prefix is known to end within the K candidates.
    """
    num_candidates = top.shape[1]
    mass = top.cumsum(dim=-1)
    mass_before = F.pad(mass[:, :-1], (1, 0))
    # A top-k beyond the candidates is unset (K covers every set one): it keeps mass 1.
    k_index = top_k.clamp(max=num_candidates) - 1
    top_k_mass = torch.where(top_k <= num_candidates, mass.gather(1, k_index), 1.0)
    position = torch.arange(num_candidates, device=top.device)
    num_kept = ((position < top_k) & (mass_before < top_p * top_k_mass)).sum(-1, keepdim=True)
    complete = (num_kept < num_candidates) | (top_k <= num_candidates)
    return num_kept, complete.squeeze(1)


def _uniforms(
    num_rows: int, generators: dict[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    """FloatTensor[R, 1] in (0, 1]; seeded rows draw from their own generator only.

    The other rows share the global generator in one call.
    """
    u = torch.rand(num_rows, 1)
    for row, generator in generators.items():
        u[row] = torch.rand(1, generator=generator)
    # 1 - [0, 1) excludes 0, whose inverse-CDF target could pick a leading zero-probability token.
    return (1.0 - u).to(device)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """LongTensor[R]: token i with probability probs[i] / sum(probs) per row; overwrites ``probs``.

    Inverse transform sampling (Devroye 1986, "Non-Uniform Random Variate Generation",
    §III.2.1): the first token whose cumulative mass reaches u * total. A zero-probability
    token adds no mass, so it is never the first to reach a target in (0, total].
    """
    cdf = torch.cumsum(probs, dim=-1, out=probs)
    # A row whose controls ban every token (NaN mass) finds no target: clamp to a valid id
    # rather than return V, which would fail the whole batch downstream.
    return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1).clamp_(max=probs.shape[1] - 1)
