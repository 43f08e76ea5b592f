"""``pagedllm bench detokenize``: the front end's incremental detokenizer, microseconds per token."""

from __future__ import annotations

import argparse
import statistics
import time
from importlib import resources

from pagedllm.engine.arg_utils import positive_int


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="whose tokenizer (default: the default model)")
    parser.add_argument(
        "--num-tokens", type=positive_int, default=2000,
        help="tokens detokenized, one update each, after a 10-token prompt (the bench text, repeated as needed)"
    )
    parser.add_argument("--runs", type=positive_int, default=5, help="timed runs; median and minimum printed")


def run(args: argparse.Namespace) -> None:
    from pagedllm.config import DEFAULT_MODEL
    from pagedllm.engine.detokenizer import IncrementalDetokenizer
    from pagedllm.models.loader import load_tokenizer, resolve_model
    from pagedllm.sampling_params import SamplingParams

    tokenizer = load_tokenizer(resolve_model(args.model or DEFAULT_MODEL))
    text = (resources.files("pagedllm.bench") / "data" / "pride_and_prejudice_ch1-2.txt").read_text()
    text_ids = tokenizer.encode(text)
    ids = (text_ids * (1 + (10 + args.num_tokens) // len(text_ids)))[: 10 + args.num_tokens]
    expected = tokenizer.decode(ids[10:], clean_up_tokenization_spaces=False)
    per_token = []
    for _ in range(args.runs):
        detok = IncrementalDetokenizer(tokenizer, ids[:10], SamplingParams(stop=["never in this text"]))
        start = time.perf_counter()
        for token_id in ids[10:]:
            detok.update([token_id])
        detok.flush()
        per_token.append((time.perf_counter() - start) / (len(ids) - 10))
        assert detok.output_text == expected, "the detokenized text differs from tokenizer.decode"
    print(f"{len(ids) - 10} tokens, one update each: median {statistics.median(per_token) * 1e6:.1f} us/token "
          f"(min {min(per_token) * 1e6:.1f})")
