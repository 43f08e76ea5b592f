"""Data parallelism: the router (no processes), the per-core metrics, the flag, and a live
``pagedllm serve --data-parallel-size 2``: a burst completes, greedy outputs equal one core's,
and killing one core fails only the requests it held while the other serves on."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import Iterator

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.dp_client import DPRouter
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.messages import SchedulerStats
from pagedllm.engine.metrics import EngineMetrics, sum_stats
from pagedllm.engine.output_processor import StepMetrics
from pagedllm.entrypoints.cli import build_parser, check_args
from pagedllm.entrypoints.openai.cli_args import engine_config
from tests.server_util import MODEL, Server, metric, metric_value, start_server, stop_server, wait_idle

SMALL = ("--kv-cache-memory", "64MiB", "--max-model-len", "512")
PROMPTS = [f"Fact number {i} about the ocean:" for i in range(8)]


# -- the router ------------------------------------------------------------------------------
def test_router_least_loaded() -> None:
    router = DPRouter(2, block_size=4, capacity_blocks=100)
    short = [1, 2, 3]  # no full block: no prefix to follow
    assert [router.route(short) for _ in range(4)] == [0, 1, 0, 1]
    router.release(1, 2)
    assert router.route(short) == 1 and router.route(short) == 1  # now the less loaded
    assert router.route(short, weight=3) == 0  # n samples count n
    assert router.loads == [5, 2]
    router.mark_dead(1)
    assert router.route(short) == 0
    router.mark_dead(0)
    with pytest.raises(EngineDeadError):
        router.route(short)


def test_router_prefix_affinity() -> None:
    router = DPRouter(2, block_size=4, capacity_blocks=100, slack=2)
    turn1 = list(range(10))  # 2 full blocks
    assert router.route(turn1) == 0
    turn2 = turn1 + [50, 51, 52, 53, 54]  # the conversation's next turn starts with the first
    # Core 0 holds its prefix: it gets it while at most `slack` requests busier than core 1.
    assert [router.route(turn2) for _ in range(2)] == [0, 0]
    assert router.loads == [3, 0]
    assert router.route(turn2) == 1  # busier by more than the slack: the least-loaded core
    # Now both hold it: the longer match wins (turn2's 3 blocks on both), ties to the less loaded.
    assert router.route(turn2) == 1
    # A different cache_salt shares no block: least-loaded; so is a prompt no core has seen (ties: core 0).
    assert router.route(turn1, cache_salt="other") == 1
    assert router.route(list(range(100, 110))) == 0
    assert router.loads == [4, 3]


def test_router_keeps_an_adapter_on_one_core() -> None:
    """A LoRA adapter's requests follow it to the core that served it (within the slack),
    whatever their prompts; another adapter, or the base model, goes by load."""
    router = DPRouter(2, block_size=4, capacity_blocks=100, slack=2)
    assert router.route([1, 2], lora_id=7) == 0
    assert [router.route([3, 4, 5], lora_id=7) for _ in range(2)] == [0, 0]
    assert router.route([1, 2], lora_id=7) == 1  # core 0 busier by more than the slack
    router.loads = [0, 3]
    assert router.route([9], lora_id=8) == 0 and router.route([9]) == 0  # by load
    router.loads = [4, 3]
    assert router.route(list(range(8)), lora_id=7) == 1  # both hold adapter 7: the less loaded


@pytest.mark.parametrize(("capacity", "expected"), [(4, 1), (2, 0)])
def test_router_forgets_beyond_capacity(capacity: int, expected: int) -> None:
    router = DPRouter(2, block_size=2, capacity_blocks=capacity)
    first, other = [1, 2, 3, 4], [7, 7, 8, 8]  # 2 blocks each
    for prompt in (first, other):  # both to core 1, made the less loaded
        router.loads = [1, 0]
        assert router.route(prompt) == 1
    # Core 1 still follows `first` if its memory holds 4 blocks; with room for 2, `other` pushed it out.
    router.loads = [0, 1]
    assert router.route(first) == expected


def test_sum_stats() -> None:
    a = SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, prefix_cache_hits=10,
                       spec_accepted_per_position=[3, 1])
    b = SchedulerStats(num_running=1, kv_cache_usage=0.1, prefix_cache_hits=5, spec_accepted_per_position=[2])
    total = sum_stats([a, b])
    assert (total.num_running, total.num_waiting, total.prefix_cache_hits) == (3, 1, 15)
    assert total.kv_cache_usage == pytest.approx(0.3) and total.spec_accepted_per_position == [5, 1]
    assert sum_stats([a]) is a


def test_metrics_per_core_gauges_summed_counters() -> None:
    m = EngineMetrics(2, 256, "m")
    for engine, running, queries, drafts, per_position, num_gen in (
        (0, 3, 10, 2, [2, 1], 1), (1, 1, 4, 1, [1, 0], 1), (0, 2, 12, 3, [3, 1], 2)
    ):
        m.record(StepMetrics(num_generation_tokens=num_gen))
        m.record_stats(engine, SchedulerStats(num_running=running, prefix_cache_queries=queries, spec_num_drafts=drafts,
                                              spec_accepted_per_position=per_position))
    text = m.render().decode()
    assert metric_value(text, "spec_decode_num_drafts_total") == 4
    assert metric_value(text, 'spec_decode_num_accepted_tokens_per_pos_total{position="0"}') == 4
    assert metric_value(text, 'spec_decode_num_accepted_tokens_per_pos_total{position="1"}') == 1
    assert metric_value(text, 'num_requests_running{engine="0"}') == 2
    assert metric_value(text, 'num_requests_running{engine="1"}') == 1
    assert metric_value(text, "prefix_cache_queries_total") == 16  # 12 on core 0 + 4 on core 1
    assert metric_value(text, "generation_tokens_total") == 4
    assert 'model_name="m"' in text
    m.remove_engine(1)
    assert 'engine="1"' not in m.render().decode()


# -- the flag --------------------------------------------------------------------------------
def test_flag() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--data-parallel-size", "2"])
    check_args(args)
    assert engine_config(args).data_parallel_size == 2
    assert engine_config(parser.parse_args(["serve", "-dp", "3"])).data_parallel_size == 3
    assert engine_config(parser.parse_args(["serve"])).data_parallel_size == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "-dp", "0"])
    with pytest.raises(ValueError, match="live view"):
        engine_config(parser.parse_args(["serve", "-dp", "2", "--enable-live-view"]))
    with pytest.raises(ValueError, match="pagedllm serve"):
        LLMEngine(EngineConfig(data_parallel_size=2))


# -- a live server with two cores --------------------------------------------------------------
def _core_pids(server: Server) -> list[int]:
    match = re.search(r"2 cores \(pids \[(\d+), (\d+)\]\)", server.log.read_text())
    assert match, server.log_tail()
    return [int(match.group(1)), int(match.group(2))]


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("dp"), *SMALL, "--data-parallel-size", "2")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def http(dp_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=dp_server.url, timeout=120) as c:
        yield c


def _completion(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def _greedy_concurrently(url: str, prompts: list[str]) -> list[str]:
    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json=_completion(p, 12)) for p in prompts))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json()["choices"][0]["text"] for r in rs]

    return asyncio.run(run())


def test_cores_pinned_and_metrics_per_core(dp_server: Server, http: httpx.Client) -> None:
    log = dp_server.log.read_text()
    for i in range(2):
        assert f"data-parallel engine core {i} of 2: pinned to cores" in log
    text = http.get("/metrics").text
    for i in range(2):
        metric_value(text, f'kv_cache_usage_perc{{engine="{i}"}}')  # a series per core (it asserts so)


def test_64_concurrent_requests_complete(dp_server: Server, http: httpx.Client) -> None:
    """Both cores serve; each request counts once in the per-request histograms, whichever
    core ran it, and every step's tokens of both cores in iteration_tokens_total."""
    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=dp_server.url, timeout=120) as c:
            body = [_completion(f"Request {i}: count to ten.", 4, ignore_eos=True) for i in range(64)]
            rs = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in body))
        return [r.json() for r in rs]

    series = ('request_success_total{finished_reason="length"}', "request_queue_time_seconds_count",
              "request_decode_time_seconds_count", "request_generation_tokens_sum", "request_prompt_tokens_sum",
              "iteration_tokens_total_sum")
    wait_idle(http)
    before = {name: metric(http, name) for name in series}
    results = asyncio.run(run())
    for r in results:
        assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 4, r
    wait_idle(http)
    num_prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    assert {name: metric(http, name) - before[name] for name in series} == {
        series[0]: 64, series[1]: 64, series[2]: 64, series[3]: 64 * 4, series[4]: num_prompt,
        series[5]: num_prompt + 64 * 4,
    }
    assert http.post("/reset_prefix_cache").json() == {"success": True}  # on both cores


def test_greedy_equals_one_core(dp_server: Server) -> None:
    """8 concurrent prompts (4 on each core) against one engine core (data parallel 1, in this
    process, one prompt at a time): a server's core is that same engine, and starting a second
    server would cost more than the rest of this module."""
    llm = LLM(MODEL, kv_cache_memory="64MiB", max_model_len=512)
    greedy = SamplingParams(max_tokens=12, temperature=0)
    expected = [llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].text for p in PROMPTS]
    del llm
    assert _greedy_concurrently(dp_server.url, PROMPTS) == expected


def test_dead_core_fails_only_its_requests(dp_server: Server, http: httpx.Client) -> None:
    """Last in this module: it kills core 1."""
    wait_idle(http)
    pids = _core_pids(dp_server)
    started = asyncio.Event()
    num_started = 0

    async def one(c: httpx.AsyncClient, i: int) -> str:
        nonlocal num_started
        body = _completion(f"Request {i}: tell me a story.", 100, ignore_eos=True, stream=True)
        async with c.stream("POST", "/v1/completions", json=body) as r:
            events = []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 1:
                    num_started += 1
                    if num_started == 8:
                        started.set()
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        return "error" if "error" in last else last["choices"][0]["finish_reason"]

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=dp_server.url, timeout=120) as c:
            tasks = [asyncio.ensure_future(one(c, i)) for i in range(8)]
            await asyncio.wait_for(started.wait(), 60)  # all 8 in flight, 4 on each core
            os.kill(pids[1], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert sorted(results) == ["error"] * 4 + ["length"] * 4, results
    health = http.get("/health")
    assert health.status_code == 503 and "engine core 1 of 2 dead" in health.json()["error"]["message"]
    assert f"pid {pids[1]}" in health.json()["error"]["message"]
    # New requests go to the surviving core; its gauges stay, the dead core's are gone.
    r = http.post("/v1/completions", json=_completion(PROMPTS[0], 4))
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    text = http.get("/metrics").text
    assert 'engine="0"' in text and 'engine="1"' not in text
    # One core of two: the server serves on, and did not take the last core's path (which logs
    # "engine core is dead" and exits after a grace period).
    log = dp_server.log.read_text()
    assert "1 of 2 engine cores serving" in log and "engine core is dead" not in log
    assert dp_server.proc.poll() is None
