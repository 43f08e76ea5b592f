"""``pagedllm bench spec``: decode throughput with speculative decoding off and on, in one run.

Two workloads of chat prompts: "copy" (repeat a list with one change, edit code, quote a
passage: the output copies its context, where n-gram drafts are accepted) and "open" (open
questions: little to copy). Each is run at every batch size with speculation off, then on,
greedy and without ``ignore_eos``, so both runs produce the same tokens and only the time
differs; ``--repeats`` such pairs back to back, each side's fastest run kept (a busy moment
only slows a run). Reported: output tokens/s, the speed-up, acceptance rate and mean
acceptance length.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

from pagedllm.engine.arg_utils import output_file, positive_int, positive_int_list

_FRUITS = (
    "apple, apricot, banana, blackberry, blueberry, cherry, coconut, cranberry, date, elderberry, fig, "
    "grape, guava, honeydew, kiwi, lemon, lime, lychee, mango, nectarine, orange, papaya, peach, pear"
)
_CITIES = (
    "Amsterdam, Berlin, Cairo, Dublin, Edinburgh, Florence, Geneva, Helsinki, Istanbul, Jakarta, Kyoto, "
    "Lisbon, Madrid, Nairobi, Oslo, Prague, Quito, Rome, Seoul, Toronto, Utrecht, Vienna, Warsaw"
)
_CODE = '''def total_price(items, tax_rate):
    subtotal = 0.0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''
_PASSAGE = (
    "The lighthouse stood on the northern cliff for two hundred years. Its keeper, an old sailor named "
    "Tomas, climbed the one hundred and twelve steps every evening to light the lamp. \"The sea forgives "
    "nothing,\" he told every visitor, \"but it always tells you what it plans to do.\" In the winter of "
    "the great storm, the lamp burned for nine nights without rest, and not a single ship was lost."
)
COPY_PROMPTS = [
    f"Repeat this list exactly, but replace kiwi with starfruit:\n{_FRUITS}",
    f"Repeat this list exactly, but replace Oslo with Bergen:\n{_CITIES}",
    f"Rename the function total_price to compute_total in this code and output the whole code:\n```python\n{_CODE}```",
    f"Add a docstring to each function of this code and output the whole code:\n```python\n{_CODE}```",
    f"Summarize this passage in three sentences, quoting the keeper's words exactly:\n{_PASSAGE}",
    f"Rewrite this passage in the present tense, changing nothing else:\n{_PASSAGE}",
    f"Sort this list alphabetically in reverse order:\n{_FRUITS}",
    f"Write this list as a numbered list, one item per line:\n{_CITIES}",
]
OPEN_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works to a ten-year-old.",
    "What are the pros and cons of living in a big city?",
    "Describe your ideal weekend in a few paragraphs.",
    "Why do cats purr? Give several hypotheses.",
    "Give me advice on learning to play the guitar as an adult.",
    "Invent a new board game and explain its rules.",
    "What would happen if the moon disappeared?",
]
WORKLOADS = {"copy": COPY_PROMPTS, "open": OPEN_PROMPTS}
PROMPTS_PER_WORKLOAD = min(map(len, WORKLOADS.values()))


@dataclass
class SpecBenchResult:
    workload: str
    batch_size: int
    speculative: bool
    num_requests: int
    output_tokens: int
    elapsed_s: float
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def run_workload(llm, prompts: list[str], batch_size: int, max_tokens: int) -> tuple[int, float]:
    """Generate for ``prompts`` in consecutive batches of ``batch_size``: (output tokens, seconds)."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        for out in llm.generate(prompts[i : i + batch_size], params, use_tqdm=False):
            tokens += len(out.outputs[0].token_ids)
    return tokens, time.perf_counter() - start


def bench_one(
    llm, name: str, prompts: list[str], batch_size: int, max_tokens: int, speculative: bool
) -> SpecBenchResult:
    spec = llm.engine.core.scheduler.spec_stats
    before = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
    tokens, elapsed = run_workload(llm, prompts, batch_size, max_tokens)
    result = SpecBenchResult(
        name, batch_size, speculative, len(prompts), tokens, elapsed,
        spec.num_drafts - before[0], spec.num_draft_tokens - before[1], spec.num_accepted_tokens - before[2],
    )
    print(_row(result), flush=True)
    return result


def _row(r: SpecBenchResult) -> str:
    spec = f", acceptance {100 * r.acceptance_rate:.1f}%, mean acceptance length {r.mean_acceptance_length:.2f}"
    return (
        f"[{r.workload} batch={r.batch_size} spec={'on' if r.speculative else 'off'}] {r.num_requests} requests, "
        f"{r.output_tokens} tokens in {r.elapsed_s:.2f} s: {r.tokens_per_s:.1f} tok/s" + (spec if r.speculative else "")
    )


def run(args: argparse.Namespace) -> None:
    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs

    kwargs = EngineArgs.from_cli_args(args).kwargs()
    spec_config = kwargs.pop("speculative_config") or args.default_spec_config
    off = LLM(**kwargs)
    tokenizer = off.get_tokenizer()
    prompts = {
        name: [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in workload[: args.num_prompts]
        ]
        for name, workload in WORKLOADS.items()
        if name in args.workloads
    }
    on = LLM(**kwargs, speculative_config=spec_config)
    warmup = [next(iter(prompts.values()))[0]]
    run_workload(off, warmup, 1, 8)
    run_workload(on, warmup, 1, 8)
    # Off and on back to back for each case, so that drifting machine load hits both alike.
    pairs = []
    for name, workload in prompts.items():
        for batch_size in args.batch_sizes:
            runs = [
                (bench_one(off, name, workload, batch_size, args.output_len, False),
                 bench_one(on, name, workload, batch_size, args.output_len, True))
                for _ in range(args.repeats)
            ]
            pairs.append(tuple(max((run[i] for run in runs), key=lambda r: r.tokens_per_s) for i in (0, 1)))

    print(f"\nspeculative_config: {spec_config}; fastest of {args.repeats} run(s) each")
    print("workload  batch  tok/s off  tok/s on  speed-up  acceptance  mean acc. len")
    for off_r, on_r in pairs:
        print(
            f"{off_r.workload:<8}  {off_r.batch_size:>5}  {off_r.tokens_per_s:>9.1f}  {on_r.tokens_per_s:>8.1f}  "
            f"{on_r.tokens_per_s / off_r.tokens_per_s:>7.2f}x  {100 * on_r.acceptance_rate:>9.1f}%  "
            f"{on_r.mean_acceptance_length:>13.2f}"
        )
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(
                [asdict(r) | {"tokens_per_s": r.tokens_per_s, "acceptance_rate": r.acceptance_rate,
                              "mean_acceptance_length": r.mean_acceptance_length} for pair in pairs for r in pair],
                f, indent=2,
            )


def _num_prompts(text: str) -> int:
    """argparse type of --num-prompts: 1 to the prompts a workload holds."""
    value = positive_int(text)
    if value > PROMPTS_PER_WORKLOAD:
        raise argparse.ArgumentTypeError(f"a workload holds {PROMPTS_PER_WORKLOAD} prompts, got {value}")
    return value


def _workloads(text: str) -> list[str]:
    """argparse type of --workloads: a comma list of WORKLOADS' names."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"must be a comma list of {', '.join(WORKLOADS)}, got {text!r}")
    return names


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--default-spec-config",
        default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}',
        help="speculative config of the 'on' runs when --speculative-config is not given",
    )
    parser.add_argument("--batch-sizes", type=positive_int_list, default=[1, 8])
    parser.add_argument("--num-prompts", type=_num_prompts, default=PROMPTS_PER_WORKLOAD,
                        help=f"prompts per workload (1 to {PROMPTS_PER_WORKLOAD})")
    parser.add_argument("--output-len", type=positive_int, default=128, help="max tokens per request")
    parser.add_argument(
        "--repeats", type=positive_int, default=1, help="off/on pairs per case; each side's fastest is reported"
    )
    parser.add_argument("--workloads", type=_workloads, default=list(WORKLOADS), help="copy,open")
    parser.add_argument("--result-json", type=output_file, default=None)
