"""Synthetic benchmark requests: prompts as token ids and the output length each should get.

Plain functions of (sizes, vocabulary, seed), so offline and serving benchmarks draw the same
requests from the same seed.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def parse_range(text: str) -> tuple[int, int]:
    """argparse type of the ``--*-len-range`` flags: "32:512" -> (32, 512); "128" -> (128, 128).

    Raises:
        argparse.ArgumentTypeError: not integers, or not 0 < LO <= HI.
    """
    lo, _, hi = text.partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        lo_i = hi_i = 0
    if not 0 < lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"must be LO:HI (or N) with integers 0 < LO <= HI, got {text!r}")
    return lo_i, hi_i


def _ordinary_ids(vocab_size: int, special_ids: set[int]) -> list[int]:
    # Special tokens (EOS, chat markers) would change what the model does, not what it costs.
    return [t for t in range(vocab_size) if t not in special_ids]


def random_requests(
    num: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    special_ids: set[int],
    seed: int,
) -> list[BenchRequest]:
    """Prompts of random non-special token ids; prompt and output lengths uniform in their ranges."""
    rng = random.Random(seed)
    ids = _ordinary_ids(vocab_size, special_ids)
    return [
        BenchRequest(rng.choices(ids, k=rng.randint(*input_range)), rng.randint(*output_range))
        for _ in range(num)
    ]


def prefix_repetition_requests(
    num: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_range: tuple[int, int],
    vocab_size: int,
    special_ids: set[int],
    seed: int,
) -> list[BenchRequest]:
    """``num_prefixes`` random shared prefixes, each request one of them plus its own random suffix
    (the workload prefix caching is for). Requests are shuffled so the prefixes interleave."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be at least 1, got {num_prefixes}")
    rng = random.Random(seed)
    ids = _ordinary_ids(vocab_size, special_ids)
    prefixes = [rng.choices(ids, k=prefix_len) for _ in range(num_prefixes)]
    requests = [
        BenchRequest(prefixes[i % num_prefixes] + rng.choices(ids, k=suffix_len), rng.randint(*output_range))
        for i in range(num)
    ]
    rng.shuffle(requests)
    return requests
