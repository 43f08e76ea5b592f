"""``pagedllm bench kv-memory``: KV blocks held per long request, sliding-window release on vs off.

No forward pass: the real scheduler and KV cache manager run with a stand-in for the model
(every sampled token is 0), so the figures are the allocator's own. "Off" keeps the same
KV cache groups and block size but gives every group a window of 0 (keep every block).
"""

from __future__ import annotations

import argparse
import dataclasses

from pagedllm.config import EngineConfig, parse_dtype
from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.arg_utils import memory_size, positive_int
from pagedllm.models.loader import load_config, resolve_model
from pagedllm.sampling_params import SamplingParams


def simulate(args: argparse.Namespace, release: bool) -> dict[str, float]:
    config = load_config(resolve_model(args.model))
    dtype = parse_dtype(args.dtype)
    kv = KVCacheConfig.for_model(config, 1, args.block_size, dtype)
    groups = kv.groups if release else [dataclasses.replace(g, window=0) for g in kv.groups]
    num_blocks = args.kv_cache_memory // kv.bytes_per_block
    manager = KVCacheManager(num_blocks, args.block_size, False, groups)
    max_len = args.prompt_len + args.output_len
    sched = Scheduler(manager, args.max_num_seqs, args.max_num_batched_tokens, max_len)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_requests):
        sched.add_request(Request(str(i), [1 + i] * args.prompt_len, params, [], max_len))
    peak_running = peak_held = decode_held = 0
    while sched.num_unfinished:
        out = sched.schedule()
        peak_running = max(peak_running, len(sched.running))
        for s in out.scheduled:
            held = sum(manager.num_held_blocks(s.request.request_id))
            peak_held = max(peak_held, held)
            if s.num_computed_before >= args.prompt_len:
                decode_held = max(decode_held, held)
        sched.update_from_output(out, [[0] if s.samples else [] for s in out.scheduled])
    return {
        "blocks": num_blocks,
        "peak_blocks_per_request": peak_held,
        "mib_per_request": peak_held * kv.bytes_per_block / 2**20,
        "decode_blocks_per_request": decode_held,
        "decode_mib_per_request": decode_held * kv.bytes_per_block / 2**20,
        "fit": num_blocks // max(peak_held, 1),
        "peak_running": peak_running,
        "preemptions": sched.num_preemptions,
    }


def run(args: argparse.Namespace) -> None:
    print(
        f"{args.model}: {args.num_requests} requests of {args.prompt_len} prompt + {args.output_len} output "
        f"tokens, KV budget {args.kv_cache_memory / 2**20:.0f} MiB, chunks of {args.max_num_batched_tokens}"
    )
    for release in (True, False):
        r = simulate(args, release)
        print(
            f"[release {'on' if release else 'off'}] {r['blocks']} blocks; one request holds at most "
            f"{r['peak_blocks_per_request']} blocks = {r['mib_per_request']:.1f} MiB (while decoding "
            f"{r['decode_blocks_per_request']} = {r['decode_mib_per_request']:.1f} MiB); {r['fit']} such requests fit; "
            f"peak running {r['peak_running']}, preemptions {r['preemptions']}"
        )


def add_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("--model", default=defaults.model,
                        help="a model with sliding-window layers (gemma-3-270m) shows the release; the default "
                        "model has none, so on and off hold the same blocks")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--block-size", type=positive_int, default=defaults.block_size)
    parser.add_argument("--kv-cache-memory", type=memory_size, default="1GiB", help="KV cache budget, e.g. 1GiB")
    parser.add_argument("--max-num-seqs", type=positive_int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--num-requests", type=positive_int, default=64)
    parser.add_argument("--prompt-len", type=positive_int, default=4096)
    parser.add_argument("--output-len", type=positive_int, default=16)
