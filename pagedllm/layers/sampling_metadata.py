"""Per-step sampling inputs: each row's parameters gathered into batched tensors.

``SamplingMetadata.build`` turns the scheduled rows' ``SamplingParams`` and token histories
into the tensors the sampler's stages read (allowed tokens, bad words, logit biases,
temperatures, top-k / top-p / min-p, penalty counts, ``min_tokens`` masks, seeded generators); a stage no row uses gets None, so the
sampler skips it. Tensors may live on any device.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams

Device = torch.device | str

_TOP_K_OFF = torch.iinfo(torch.int64).max  # larger than any vocabulary


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingRow:
    """One batch position that samples a token, and what the sampler needs to know about it.

    ``generator`` (a CPU ``torch.Generator``) makes the row's draws depend on its seed only.
    ``eos_token_ids`` are masked together with ``params.stop_token_ids`` while
    ``len(output_token_ids) < params.min_tokens``, unless ``params.ignore_eos``.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None


@dataclass(frozen=True, slots=True)
class PenaltyTensors:
    """Penalties (vLLM semantics) of the rows that use any, as each row's token history.

    Only tokens of a row's prompt or output are penalized, so the sampler rewrites those
    logits instead of building [S, V] count tensors.

    Attributes:
        rows: LongTensor[P], the batch rows with a repetition, presence or frequency penalty.
        tokens: IntTensor[N], row after row: the row's prompt tokens (only where it has a
            repetition penalty), then its output tokens.
        offsets: LongTensor[P + 1], row p's tokens are ``tokens[offsets[p] : offsets[p + 1]]``.
        num_prompt: LongTensor[P], how many of those are the prompt's.
        repetition: FloatTensor[P] (1: off); a distinct token's logit is divided by it where
            positive, else multiplied.
        presence, frequency: FloatTensor[P] (0: off); each distinct output token's logit loses
            ``frequency * count + presence``, after the repetition penalty.
    """

    rows: torch.Tensor
    tokens: torch.Tensor
    offsets: torch.Tensor
    num_prompt: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor


@dataclass(frozen=True, slots=True)
class TruncationTensors:
    """Top-k / top-p settings of the sampling rows that use either.

    Attributes:
        rows: LongTensor[T], indices into the sampling rows (``SamplingMetadata.random_rows``).
        other_rows: LongTensor[R - T], the sampling rows without top-k or top-p.
        top_k: LongTensor[T, 1]; rows without top-k hold a value larger than any vocabulary.
        top_p: FloatTensor[T, 1]; rows without top-p hold ``inf``.
        max_top_k: the largest top-k set (0 if none), so one ``topk`` call covers every row.
    """

    rows: torch.Tensor
    other_rows: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    max_top_k: int


@dataclass(frozen=True, slots=True)
class AllowedTokens:
    """``allowed_token_ids`` of the rows that set it: all other logits of those rows are -inf.

    Attributes:
        rows: LongTensor[A], the batch rows that restrict their tokens.
        kept: (LongTensor[N] batch row, LongTensor[N] token id), each row's allowed tokens.
    """

    rows: torch.Tensor
    kept: tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class LogitBias:
    """``logit_bias`` of the batch as one sparse update: ``values`` added at ``index``.

    Attributes:
        index: (LongTensor[N] batch row, LongTensor[N] token id).
        values: FloatTensor[N], the biases.
    """

    index: tuple[torch.Tensor, torch.Tensor]
    values: torch.Tensor


@dataclass(frozen=True, slots=True)
class SamplingMetadata:
    """Per-step tensors for ``Sampler``, built once from the batch's rows.

    Every optional field is None when no row needs that stage, which is how the sampler
    skips it. "Sampling rows" are the rows with temperature > 0, in batch order.

    Attributes:
        random_rows: LongTensor[R], the batch rows that sample; None when all S rows do.
        greedy_rows: LongTensor[S - R], the others.
        temperature: FloatTensor[R, 1]; None when all sampling rows have temperature 1.
        truncation: top-k / top-p of the sampling rows that use them.
        min_p: FloatTensor[R, 1]; None when no sampling row uses min-p.
        generators: index into the sampling rows -> that row's seeded generator.
        allowed_tokens: the rows with ``allowed_token_ids`` and those ids.
        bad_words_mask: (LongTensor[B] batch row, LongTensor[B] token id) pairs whose logit is
            set to -inf because they would complete one of the row's ``bad_words``.
        logit_bias: the biases of the rows with ``logit_bias``.
        penalties: repetition / presence / frequency penalties.
        min_tokens_mask: (LongTensor[M] batch row, LongTensor[M] token id) pairs whose logit is
            set to -inf because the row is still below ``min_tokens``.
        max_num_logprobs: the largest ``logprobs`` asked by any row; None when no row asked.
        grammar_mask: (IntTensor[G, ceil(V / 32)] bitmask, G batch rows): the structured-output
            rows' allowed next tokens, one bit per token (``structured_output.bitmask``); set
            by the model runner, which owns the grammars.
    """

    random_rows: torch.Tensor | None
    greedy_rows: torch.Tensor
    all_greedy: bool
    temperature: torch.Tensor | None
    truncation: TruncationTensors | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    allowed_tokens: AllowedTokens | None
    bad_words_mask: tuple[torch.Tensor, torch.Tensor] | None
    logit_bias: LogitBias | None
    penalties: PenaltyTensors | None
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None
    max_num_logprobs: int | None
    grammar_mask: tuple[torch.Tensor, list[int]] | None = None

    @property
    def no_penalties(self) -> bool:
        return self.penalties is None

    @property
    def no_top_k_top_p(self) -> bool:
        return self.truncation is None

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], device: Device = "cpu") -> SamplingMetadata:
        """Gather the per-row settings of one step into tensors on ``device``."""
        random_idx = [i for i, row in enumerate(rows) if not row.params.greedy]
        randoms = [rows[i].params for i in random_idx]
        temperatures = [p.temperature for p in randoms]
        logprobs = [row.params.logprobs for row in rows if row.params.logprobs is not None]
        return cls(
            random_rows=None if len(randoms) == len(rows) else _indices(random_idx, device),
            greedy_rows=_indices([i for i, row in enumerate(rows) if row.params.greedy], device),
            all_greedy=not randoms,
            temperature=(
                None if all(t == 1.0 for t in temperatures) else _column(temperatures, device)
            ),
            truncation=_build_truncation(randoms, device),
            min_p=(
                _column([p.min_p for p in randoms], device)
                if any(p.min_p > 0.0 for p in randoms)
                else None
            ),
            generators={
                j: gen for j, i in enumerate(random_idx) if (gen := rows[i].generator) is not None
            },
            allowed_tokens=_build_allowed_tokens(rows, device),
            bad_words_mask=_build_bad_words_mask(rows, device),
            logit_bias=_build_logit_bias(rows, device),
            penalties=_build_penalties(rows, device),
            min_tokens_mask=_build_min_tokens_mask(rows, device),
            max_num_logprobs=max(logprobs, default=None),
        )


def _indices(values: Sequence[int], device: Device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _column(values: Sequence[float], device: Device) -> torch.Tensor:
    """FloatTensor[N, 1], one value per row, to broadcast over the vocabulary."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _coo(
    row_ids: Sequence[int], lists: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged per-row token lists as (LongTensor[N] batch row, LongTensor[N] token id), on CPU."""
    lengths = torch.tensor([len(ids) for ids in lists], dtype=torch.long)
    batch_rows = torch.repeat_interleave(torch.tensor(row_ids, dtype=torch.long), lengths)
    tokens = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.long)
    return batch_rows, tokens


def _build_truncation(
    randoms: Sequence[SamplingParams], device: Device
) -> TruncationTensors | None:
    used = [j for j, p in enumerate(randoms) if p.top_k > 0 or p.top_p < 1.0]
    if not used:
        return None
    top_ks = [randoms[j].top_k or _TOP_K_OFF for j in used]
    # top_p = 1 is off; inf makes "mass before < top_p" hold even where float sums reach 1.
    top_ps = [randoms[j].top_p if randoms[j].top_p < 1.0 else torch.inf for j in used]
    return TruncationTensors(
        rows=_indices(used, device),
        other_rows=_indices(sorted(set(range(len(randoms))) - set(used)), device),
        top_k=_indices(top_ks, device).unsqueeze(1),
        top_p=_column(top_ps, device),
        max_top_k=max((k for k in top_ks if k != _TOP_K_OFF), default=0),
    )


def _build_penalties(rows: Sequence[SamplingRow], device: Device) -> PenaltyTensors | None:
    params = [row.params for row in rows]
    penalized = [
        i for i, p in enumerate(params)
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    ]
    if not penalized:
        return None
    prompts = [rows[i].prompt_token_ids if params[i].repetition_penalty != 1.0 else () for i in penalized]
    outputs = [rows[i].output_token_ids for i in penalized]
    num_prompt = [len(p) for p in prompts]
    offsets = np.zeros(len(penalized) + 1, dtype=np.int64)
    np.cumsum([a + len(b) for a, b in zip(num_prompt, outputs)], out=offsets[1:])
    tokens = np.fromiter(
        itertools.chain.from_iterable(itertools.chain(p, o) for p, o in zip(prompts, outputs)),
        dtype=np.int32, count=int(offsets[-1]),
    )

    def per_row(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    return PenaltyTensors(
        rows=_indices(penalized, device),
        tokens=torch.from_numpy(tokens).to(device),
        offsets=torch.from_numpy(offsets).to(device),
        num_prompt=_indices(num_prompt, device),
        repetition=per_row([params[i].repetition_penalty for i in penalized]),
        presence=per_row([params[i].presence_penalty for i in penalized]),
        frequency=per_row([params[i].frequency_penalty for i in penalized]),
    )


def _build_min_tokens_mask(
    rows: Sequence[SamplingRow], device: Device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    short = [i for i, row in enumerate(rows) if len(row.output_token_ids) < row.params.min_tokens]

    def banned(row: SamplingRow) -> list[int]:
        return [*row.params.stop_token_ids, *([] if row.params.ignore_eos else row.eos_token_ids)]

    lists = [banned(rows[i]) for i in short]
    if not any(lists):
        return None
    batch_rows, tokens = _coo(short, lists)
    return batch_rows.to(device), tokens.to(device)


def _build_allowed_tokens(rows: Sequence[SamplingRow], device: Device) -> AllowedTokens | None:
    restricted = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if not restricted:
        return None
    batch_rows, tokens = _coo(restricted, [rows[i].params.allowed_token_ids for i in restricted])
    return AllowedTokens(_indices(restricted, device), (batch_rows.to(device), tokens.to(device)))


def _build_bad_words_mask(
    rows: Sequence[SamplingRow], device: Device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """vLLM's rule: a one-token word's token is always banned; a longer word's last token is
    banned when the output ends with the word's other tokens."""
    banned_rows: list[int] = []
    banned_lists: list[list[int]] = []
    for i, row in enumerate(rows):
        words = row.params.bad_words_token_ids
        if not words:
            continue
        output = list(row.output_token_ids)
        banned = [w[-1] for w in words if len(w) == 1 or output[len(output) - len(w) + 1 :] == w[:-1]]
        if banned:
            banned_rows.append(i)
            banned_lists.append(banned)
    if not banned_rows:
        return None
    batch_rows, tokens = _coo(banned_rows, banned_lists)
    return batch_rows.to(device), tokens.to(device)


def _build_logit_bias(rows: Sequence[SamplingRow], device: Device) -> LogitBias | None:
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    if not biased:
        return None
    batch_rows, tokens = _coo(biased, [list(rows[i].params.logit_bias) for i in biased])
    values = [v for i in biased for v in rows[i].params.logit_bias.values()]
    return LogitBias(
        (batch_rows.to(device), tokens.to(device)), torch.tensor(values, dtype=torch.float32, device=device)
    )
