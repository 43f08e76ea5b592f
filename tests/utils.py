"""Helpers shared by the test modules: a live server subprocess, the server's request bodies
and error check, the block pool checks, the sampler tests' rows, a streamed tool-call reader,
hostile grammar inputs, random GGUF blocks and the error bound of attention in bfloat16 pairs,
the command line tests' flags of a small engine, and the live view's scripted runs. Tiny
models: ``models_util.py``.

Test modules import from here, never from one another.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import torch

from pagedllm.config import MODEL_RUNNER_CLS_ENV
from pagedllm.core.kv_cache_groups import KVCacheGroup
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.distributed.parallel_state import free_port
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagedllm.kernels.attention import INT8_WEIGHT_FLOOR, int8_cache_queries
from pagedllm.layers.sampler import Sampler, SamplerOutput
from pagedllm.layers.sampling_metadata import SamplingMetadata, SamplingRow
from pagedllm.live_view.recorder import StepRecorder
from pagedllm.live_view.records import StepRecord
from pagedllm.live_view.view import LiveView
from pagedllm.sampling_params import SamplingParams
from tests.fault_injection import FAULTY_RUNNER

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = 240
API_KEY = "test-key"
MAX_BODY = 64 * 1024
# The session's shared server (conftest.py, ``shared_server``): float32, so that outputs do not
# depend on batching or prefix-cache hits (streamed equals non-streamed); an API key and a small
# body limit, which the tests of both check; the fault-injection hook, which acts only on
# requests that ask for a fault (``cache_salt="fault:..."``).
SHARED_SERVER_FLAGS = ("--dtype", "float32", "--api-key", API_KEY, "--max-request-body-size", str(MAX_BODY))
SHARED_SERVER_ENV = {MODEL_RUNNER_CLS_ENV: FAULTY_RUNNER}  # the fault-injection hook (tests/fault_injection.py)
ROOT = Path(__file__).resolve().parents[1]  # ``python -m`` runs this tree's pagedllm from any cwd
# The ``pagedllm`` command's flags for a small float32 engine (the test_cli_* modules).
CLI_SMALL = ["--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--dtype", "float32"]


class Server:
    """A server subprocess and how to reach it."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc = proc
        self.url = url
        self.log = log

    def engine_pid(self) -> int:
        """The engine-core process: the server's spawned child (not multiprocessing's resource tracker)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                return int(pid)
        raise AssertionError(f"no engine-core child among {children}")

    def log_tail(self) -> str:
        return self.log.read_text()[-4000:]


def start_server(tmp_path: Path, *extra: str, model: str = MODEL, env: dict[str, str] | None = None) -> Server:
    """``pagedllm serve`` of ``model`` with the test defaults and ``extra`` flags (later flags
    win), its log in ``tmp_path``; ``env``: variables added to this process's environment.
    Returns once ``/health`` answers 200; AssertionError (with the log's tail) if it exits or
    does not start in ``STARTUP_TIMEOUT_S``."""
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    cmd = [
        sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", model,
        "--port", str(port), "--kv-cache-memory", "512MiB", "--max-model-len", str(MAX_MODEL_LEN),
        "--disable-access-log", *extra,
    ]
    with open(log, "wb") as f:  # a file, not a pipe: nobody drains a pipe while tests run
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, **env} if env else None)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"server did not start in {STARTUP_TIMEOUT_S} s:\n{server.log_tail()}")


def streamed_calls(client: openai.OpenAI, **kwargs) -> tuple[str, dict[int, dict], str | None]:
    """A streamed chat completion's (content, index -> {id, name, arguments}, finish reason),
    joined from its deltas; each call's id and name must come before its arguments."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id:
                assert call["id"] is None and call["arguments"] == ""  # id and name come first
                call["id"], call["name"] = piece.id, piece.function.name
            call["arguments"] += piece.function.arguments or ""
    return content, calls, finish


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


def metric_value(text: str, name: str) -> float:
    """A metric's value in a Prometheus text exposition, summed over its series (a per-core
    gauge's cores); ``name`` may end in labels its series must have, e.g.
    ``'request_success_total{finished_reason="stop"}'``."""
    base, _, wanted = name.partition("{")
    labels = re.compile(r'(\w+)="([^"]*)"')
    want = set(labels.findall(wanted))
    values = [float(value) for series, found, value in re.findall(r"^pagedllm:(\S+?)(?:\{(.*)\})? (\S+)$", text, re.M)
              if series == base and want <= set(labels.findall(found))]
    assert values, f"pagedllm:{name} not in /metrics"
    return sum(values)


def metric(http: httpx.Client, name: str) -> float:
    """``metric_value`` of the server's /metrics."""
    return metric_value(http.get("/metrics").text, name)


def wait_idle(http: httpx.Client, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(http, "num_requests_running") == 0 and metric(http, "kv_cache_usage_perc") == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"engine not idle: running={metric(http, 'num_requests_running')}, "
                         f"kv={metric(http, 'kv_cache_usage_perc')}")


# The OpenAI-compatible server's request bodies and error answers (the test_server_* modules).
CHAT = [{"role": "user", "content": "Name three colors."}]


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, **fields}


def _num_tokens(http: httpx.Client, **body) -> int:
    return http.post("/tokenize", json=body).json()["count"]


def _check_error(r: httpx.Response, status: int, needle: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert needle in error["message"], error


def _whole(pool) -> bool:
    return pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def pool_is_whole(llm) -> bool:
    """Every block of an ``LLM``'s KV cache pool is free, no reference held."""
    return _whole(llm.engine.core.kv_cache.pool)


def assert_pool_whole(owner) -> None:
    """Every block of the KV cache pool of ``owner`` (a ``Scheduler`` or an ``EngineCore``: what
    has a ``kv_cache``) is free, no reference held."""
    pool = owner.kv_cache.pool
    assert _whole(pool), f"{pool.num_blocks - pool.num_free_blocks} of {pool.num_blocks} blocks held"


# --- the sampler's rows and one sampler call (the test_sampler_* modules) -------------------

def row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: list[int] | None = None,
    seed: int | None = None,
    **params: object,
) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(seed=seed, **params),
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        eos_token_ids=eos or [],
        generator=None if seed is None else torch.Generator().manual_seed(seed),
    )


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    return Sampler()(logits, SamplingMetadata.build(rows))


# --- hostile grammar inputs: n rules, n levels, n properties -------------------------------

def lark_chain(n: int) -> str:
    """The grammar that overflowed llguidance's stack at n = 3000: a chain of n rules."""
    return "start: r0\n" + "\n".join(f'r{i}: r{i + 1} "{i}" | "z"' for i in range(n)) + f'\nr{n}: "end"'


def ref_chain(n: int) -> dict:
    """A JSON schema whose ``$ref``s chain through n definitions."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_arrays(n: int) -> dict:
    """A JSON schema of arrays nested n deep around a string."""
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


def many_properties(n: int) -> dict:
    """A JSON schema of an object with n string properties."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def assert_holds_blocks(layer, parts) -> None:
    """``layer`` runs these GGUF blocks ([(ggml type, [rows, ...] uint8)], fused order) as
    stored: a KQuantLinear holds their panels byte for byte (``kernels.kquant.panels``), a
    Q8A8Linear (a weight all of Q8_0) their packing (``kernels.linear.linear_pack_q8_0``)."""
    import gguf

    from pagedllm.kernels import kquant
    from pagedllm.kernels.linear import linear_pack_q8_0
    from pagedllm.layers.quantization.linear import KQuantLinear, Q8A8Linear

    parts = [(int(qtype), blocks.flatten(1)) for qtype, blocks in parts]
    if isinstance(layer, Q8A8Linear):
        assert [q for q, _ in parts] == [int(gguf.GGMLQuantizationType.Q8_0)]
        codes, d = linear_pack_q8_0(parts[0][1], layer.in_features)
        assert torch.equal(layer.packed, codes) and torch.equal(layer.d, d)
        return
    assert isinstance(layer, KQuantLinear)
    want = kquant.panels(kquant.StoredWeight(parts, layer.in_features))
    assert isinstance(layer.stored, kquant.PanelWeight) and want is not None
    assert [(q, rows) for q, _, rows in layer.stored.parts] == [(q, rows) for q, _, rows in want.parts]
    assert all(torch.equal(got[1], w[1]) for got, w in zip(layer.stored.parts, want.parts, strict=True))


def random_gguf_blocks(qtype, n: int, k: int, seed: int = 0, scale: float = 1.0):
    """[n, row bytes] uint8 GGUF blocks of ggml type ``qtype`` (Q8_0, Q5_0, Q4_K, Q5_K, Q6_K)
    for rows of k weights: random codes, scales and mins (every bit pattern), finite float16
    d (and a positive dmin) of a small model's magnitude times ``scale`` (the same codes for
    any ``scale`` of one seed)."""
    import gguf
    import torch

    q = gguf.GGMLQuantizationType
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // elems, size), dtype=torch.uint8, generator=gen)

    def half(scale: float) -> torch.Tensor:
        return (torch.randn(n, k // elems, 1, generator=gen) * scale).half().view(torch.uint8)

    if qtype in (q.Q4_K, q.Q5_K):
        blocks[..., 0:2] = half(1e-3 * scale)
        blocks[..., 2:4] = half(1e-3 * scale).view(torch.float16).abs().view(torch.uint8)
    elif qtype == q.Q6_K:
        blocks[..., 208:210] = half(1e-3 * scale)
    else:
        blocks[..., 0:2] = half(1e-2 * scale)
    return blocks.view(n, -1)


def bfloat16_pair_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Twice the largest error of attention in bfloat16 pairs (``kernels.attention.
    attention_in_bfloat16_pairs``) against float32 over the same K/V, per output element
    ([n, H * D]) of queries q [n, H, D] over keys and values [L, Hkv, D]: each score's q and k
    rounded to bfloat16 (relative 2^-9 each) move it by at most delta = 2^-8 scale sum_d
    |q_d k_d|, which moves the normalized weights by a factor within e^(+-2 delta); the weights
    and the values rounded (2^-9 each) move the output by at most 2^-8 max |v| more."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1).abs(), v.repeat_interleave(group, dim=1).abs()
    delta = 2**-8 * scale * torch.einsum("qhd,khd->qhk", q.abs(), kk).amax(-1, keepdim=True)  # [n, H, 1]
    vmax = vv.amax(0)[None]  # [1, H, D]
    return (2 * (torch.exp(2 * delta) - 1 + 2**-8) * vmax).reshape(q.shape[0], -1)


def assert_int8_attention(got, q, k, v_rows, first, scale, window=0):
    """``got`` [n, H * D] is attention over an int8 cache as the kernels compute it, decode and
    prefill alike: q [n, H, D] at the last n of positions first .. first + L - 1 of k [L, Hkv, D]
    (the keys' values) and v_rows [L, Hkv, D + 2] (the value rows as stored), causal, window > 0:
    a query at p sees keys p - window + 1 .. p. The kernels score each query as int8 codes
    (``int8_cache_queries``) and, per query head and tile of 16 positions (from a multiple of
    16), take the softmax weights times the value rows' scales as codes in [0, 127] against the
    value codes, times the tile's code scale, divided by the weights' sum. Every element lies
    within half a weight code per key of float32 attention on those queries (+ 1e-4), and all
    but a few (query, head) rows equal that computation to 1e-4: a code at a rounding tie goes
    either way with the last bit of the kernel's exp (a row's output moves by a code step)."""
    n, h, d = q.shape
    length = k.shape[0]
    ref, bound = torch.empty(n, h, d), torch.empty(n, h, d)
    for i in range(n):
        end = length - n + i + 1  # keys [lo, end) of k
        lo = max(0, end - window) if window else 0
        ref[i], bound[i] = _int8_one_query(q[i : i + 1], k[lo:end], v_rows[lo:end], first + lo, scale)
    values = v_rows[..., :d].float() * v_rows[..., d:].contiguous().view(torch.float16).float()
    group = h // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", int8_cache_queries(q, scale), kk) * scale
    q_pos, k_pos = torch.arange(length - n, length)[None, :, None], torch.arange(length)[None, None, :]
    masked = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else torch.zeros((), dtype=torch.bool))
    dense = torch.einsum("hqk,khd->qhd", scores.masked_fill(masked, float("-inf")).softmax(-1), vv)
    got = got.reshape(n, h, d)
    assert ((got - dense).abs() <= bound * (1 + 1e-3) + 1e-4).all()
    off = ((got - ref).abs() > 1e-4).any(-1)
    assert off.float().mean() <= 0.02, f"{int(off.sum())} of {off.numel()} (query, head) rows differ"


def _int8_one_query(q, k, v_rows, first, scale):
    """The kernels' attention of one query [1, H, D] over all of k / v_rows, at positions first
    on (``assert_int8_attention``), and the bound of its weight codes' rounding: half a code
    step per key, times |value|, over the weights' sum. Two [H, D]."""
    h, d = q.shape[1], q.shape[2]
    group = h // k.shape[1]
    codes = v_rows[..., :d].float().repeat_interleave(group, 1)  # [L, H, D]
    v_scales = v_rows[..., d:].contiguous().view(torch.float16).float()[..., 0].repeat_interleave(group, 1)  # [L, H]
    scores = torch.einsum("hd,khd->hk", int8_cache_queries(q, scale)[0], k.repeat_interleave(group, 1)) * scale
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    w = e * v_scales.T  # [H, L]
    tiles = (first + torch.arange(k.shape[0])) // 16
    out, bound = torch.zeros(h, d), torch.zeros(h, d)
    for t in tiles.unique():
        keys = tiles == t
        wt = w[:, keys]
        mx = wt.amax(-1, keepdim=True)
        live = mx > INT8_WEIGHT_FLOOR
        wc = (wt * torch.where(live, mx.new_tensor(127.0) / mx, 0.0)).round()
        out += torch.einsum("hk,khd->hd", wc, codes[keys]) * (mx / 127.0)
        bound += (mx / 254.0) * codes[keys].abs().sum(0)
    total = e.sum(-1, keepdim=True)
    return out / total, bound / total


# --- the live view's scripted runs (the test_live_view_* modules) ----------------------------

LIVE_VIEW_EOS = 2
LIVE_VIEW_BS = 4  # tokens per block
LIVE_VIEW_GLOBAL = (KVCacheGroup((0,), 0),)  # one KV cache group, no sliding window


def make_engine(groups, num_blocks=20, budget=24):
    """A scheduler (6 sequences, ``budget`` tokens a step, 256 tokens long) over a prefix-caching KV
    cache of ``num_blocks`` blocks of ``LIVE_VIEW_BS`` tokens in ``groups``, and its step recorder."""
    kv = KVCacheManager(num_blocks, LIVE_VIEW_BS, True, groups)
    recorder = StepRecorder(kv)
    return Scheduler(kv, 6, budget, 256), recorder


def make_request(rid, rng, prefixes):
    """A request: one of ``prefixes`` and 1-14 random tokens, then 2-12 tokens out, EOS ignored."""
    prompt = rng.choice(prefixes) + [rng.randint(10, 90) for _ in range(rng.randint(1, 14))]
    params = SamplingParams(max_tokens=rng.randint(2, 12), ignore_eos=True)
    return Request(rid, prompt, params, [LIVE_VIEW_EOS], 256)


def fake_step(sched, recorder, rng) -> StepRecord:
    """What EngineCore.step does, with a fake model that accepts a random run of each request's drafts."""
    for r in sched.running:  # a proposer's drafts for some decoding requests
        if r.num_output_tokens and rng.random() < 0.4:
            r.spec_token_ids = [rng.randint(10, 90) for _ in range(rng.randint(1, 3))]
    recorder.begin(sched)
    out = sched.schedule()
    entries = recorder.entries(out)
    sampled = []
    for s in out.scheduled:
        accepted = s.spec_token_ids[: rng.randint(0, len(s.spec_token_ids))]
        sampled.append(accepted + [7] if s.samples else [])
    sched.update_from_output(out, sampled)
    return recorder.finish(sched, sched.kv_cache.usage, entries, out, sampled)


def scripted_run(groups, seed):
    """A run with shared prefixes, preemptions, drafts, aborts and a prefix-cache reset; yields each record."""
    rng = random.Random(seed)
    sched, recorder = make_engine(groups)
    prefixes = [[rng.randint(10, 90) for _ in range(8)] for _ in range(3)]
    for i in range(24):
        sched.add_request(make_request(f"r{i}", rng, prefixes))
        yield fake_step(sched, recorder, rng), sched
        if i % 7 == 6 and sched.running:  # an abort between steps
            sched.finish_requests([sched.running[0].request_id], RequestStatus.FINISHED_ABORTED)
    while sched.num_unfinished:
        yield fake_step(sched, recorder, rng), sched
    assert sched.kv_cache.reset_prefix_cache()
    yield recorder.finish(sched, sched.kv_cache.usage), sched  # the idle record after the reset


def feed_view(max_steps=4096):
    """A LiveView fed as the front end feeds it: arrivals, then every record with its outputs."""
    view = LiveView(20, LIVE_VIEW_BS, [0], 24, max_steps=max_steps)
    for _ in fed_steps(view, stops=False):
        pass
    return view


def fed_steps(view, stops=True):
    """Feed ``view`` as the front end does, yielding after each change; ``stops``: now and then a
    stop string found by the front end finishes a request."""
    seen = set()
    for record, sched in scripted_run(LIVE_VIEW_GLOBAL, 4):
        for rid, r in sched.requests.items():
            if rid not in seen:
                seen.add(rid)
                view.on_arrival([EngineCoreRequest(rid, r.prompt_token_ids, r.sampling_params, [LIVE_VIEW_EOS],
                                                   r.arrival_time)])
        outputs = [EngineCoreOutput(e.request_id, [7] if e.decode or e.prefill else []) for e in record.scheduled]
        view.on_outputs(EngineCoreOutputs(outputs, timestamp=record.end, step=record))
        for e in record.scheduled[:1] if stops else ():
            if record.index % 9 == 8:
                view.on_finish([e.request_id], "stop", record.end)
        yield
