"""``pagedllm bench perplexity``: sliding-window perplexity of a text, through the engine's
own prompt-logprob path (``SamplingParams(max_tokens=0, prompt_logprobs=0)``).

The windows follow the transformers perplexity guide: a window of ``window`` tokens starts
every ``stride`` tokens, and scores only the tokens past the previous window's end, so every
token but the first is scored once, with at least ``window - stride`` tokens of context
(fewer in the first window; with ``stride == window`` each window's first token goes
unscored, having none). The text is tokenized without special tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedllm.engine.arg_utils import input_file, output_file, positive_int
from pagedllm.quantization_config import MODES

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "pride_and_prejudice_ch1-2.txt"


@dataclass(frozen=True)
class Window:
    """Tokens ``[start, end)`` of the text fed as one prompt; ``[first_scored, end)`` scored."""

    start: int
    end: int
    first_scored: int


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """The windows over a text of ``num_tokens`` tokens.

    Raises:
        ValueError: unless ``1 <= stride <= window``, ``window >= 2`` and the text has 2 tokens.
    """
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window, got window {window}, stride {stride}")
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    windows, prev_end = [], 0
    for start in range(0, num_tokens, stride):
        end = min(start + window, num_tokens)
        windows.append(Window(start, end, max(prev_end, start + 1)))
        prev_end = end
        if end == num_tokens:
            break
    return windows


@dataclass
class PerplexityResult:
    label: str
    num_tokens: int
    window: int
    stride: int
    num_windows: int
    num_scored: int
    mean_nll: float  # nats per scored token
    elapsed_s: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    def report(self, reference: PerplexityResult | None = None) -> str:
        line = (
            f"[{self.label}] perplexity {self.perplexity:.4f} over {self.num_scored} tokens "
            f"(window {self.window}, stride {self.stride}, {self.num_windows} windows) in {self.elapsed_s:.1f} s"
        )
        if reference is not None and reference is not self:
            line += f", {100 * (self.perplexity / reference.perplexity - 1):+.2f}% vs [{reference.label}]"
        return line


def perplexity(llm, token_ids: list[int], window: int, stride: int, label: str) -> PerplexityResult:
    """Perplexity of ``token_ids`` under ``llm`` (a ``pagedllm.LLM``), all windows in one batch."""
    from pagedllm import SamplingParams

    windows = sliding_windows(len(token_ids), window, stride)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    start = time.perf_counter()
    outputs = llm.generate([token_ids[w.start : w.end] for w in windows], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    nll, count = 0.0, 0
    for w, out in zip(windows, outputs, strict=True):
        # prompt_logprobs[i]: {token id: Logprob} at position i of the window (None at 0).
        for i in range(w.first_scored - w.start, w.end - w.start):
            nll -= out.prompt_logprobs[i][out.prompt_token_ids[i]].logprob
            count += 1
    return PerplexityResult(label, len(token_ids), window, stride, len(windows), count, nll / count, elapsed)


def quantization_modes(text: str) -> list[str]:
    """argparse type of --compare: a comma list of quantization modes, each checked now (not
    after the runs before it).

    Raises:
        argparse.ArgumentTypeError: a name that is no mode.
    """
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    return modes


def mode_kwargs(mode: str | None, quantize_lm_head: bool | None) -> dict[str, object]:
    """The ``LLM`` keywords of one run: quantization ``mode`` (None: as the dtype decides) with
    the lm_head quantized where ``--quantize-lm-head`` was given and the mode quantizes; the
    flag absent, ``quantize_lm_head`` is left out, so the dtype decides it (auto: quantized,
    as ``LLM(model)`` runs it; a keyword given would win over the dtype)."""
    if quantize_lm_head is None:
        return {"quantization": mode}
    return {"quantization": mode, "quantize_lm_head": quantize_lm_head and mode != "none"}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--file", type=input_file, default=DEFAULT_TEXT, help="UTF-8 text (default: a shipped public-domain text)"
    )
    parser.add_argument("--window", type=positive_int, default=512, help="tokens per window")
    parser.add_argument("--stride", type=positive_int, default=256, help="tokens between window starts")
    parser.add_argument(
        "--compare",
        type=quantization_modes,
        default="",
        help="more quantization modes to run after --quantization, reported relative to it, e.g. int8,int4",
    )
    parser.add_argument("--result-json", type=output_file, default=None, help="write the results to this JSON file")


def run(args: argparse.Namespace) -> None:
    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs

    text = args.file.read_text(encoding="utf-8")
    kwargs = EngineArgs.from_cli_args(args).kwargs()
    modes = [args.quantization, *args.compare]
    results: list[PerplexityResult] = []
    token_ids: list[int] = []
    for mode in modes:
        llm = LLM(**(kwargs | mode_kwargs(mode, args.quantize_lm_head)))
        if not token_ids:
            token_ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
        quant = llm.engine.core.config.quantization_config()  # what the engine resolved (dtype auto: w8a8)
        label = f"{'none' if quant is None else quant.describe()}, {args.dtype}"
        results.append(perplexity(llm, token_ids, args.window, args.stride, label))
        print(results[-1].report(results[0]), flush=True)
        del llm
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump([asdict(r) | {"perplexity": r.perplexity, "file": str(args.file)} for r in results], f, indent=2)
