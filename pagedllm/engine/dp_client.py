"""Data parallelism: one front end over N engine-core processes, each a full model replica
with its own KV cache (``pagedllm serve --data-parallel-size N``).

Each core is an ``AsyncMPClient`` with its own sockets and process; this module adds the
routing of requests between them (``DPRouter``, pure bookkeeping) and the client that owns
the N cores (``DPAsyncMPClient``): a request lives on one core from start to end, its aborts
go there, utility calls go to every live core. A core that dies is dropped from routing; the
others keep serving.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.core_client import AsyncMPClient, EngineDeadError
from pagedllm.engine.core_proc import EngineCoreReady
from pagedllm.engine.messages import EngineCoreOutputs, EngineCoreRequest

# How many more outstanding requests than the least-loaded core the core holding a prompt's
# prefix may have and still get it: a prefix hit saves a prefill, a queue behind 4 more
# requests costs more than that on a small replica.
AFFINITY_SLACK = 4


def check_data_parallel(config: EngineConfig) -> None:
    """Refuse what one front end over several cores cannot do.

    Raises:
        ValueError: the live view with ``data_parallel_size > 1`` (it draws one core's KV cache).
    """
    if config.data_parallel_size > 1 and config.live_view:
        raise ValueError(
            "the live view (--enable-live-view) draws one engine core's KV cache: it cannot be combined with "
            f"--data-parallel-size {config.data_parallel_size}; run it at data parallel size 1"
        )


class DPRouter:
    """Chooses the engine core of each request. No processes: the state is what was sent where.

    Load of a core: its outstanding engine-core requests (sent to it, not yet finished or
    aborted; a request with ``n`` samples counts ``n``), counted here as requests are sent, so
    that a burst is spread at once rather than on stats the cores report a step later.

    Prefix affinity: each core remembers the chained hashes of the full prompt blocks sent to
    it (least recently sent dropped first, at most ``capacity_blocks``: what its prefix cache
    can hold). A request goes to the live core that holds the most of its leading blocks (ties:
    the less loaded, then the lower index), unless that core's load exceeds the least-loaded
    live core's by more than ``slack``; a request no core has a block of, or whose best core
    is overloaded so, goes to the least-loaded live core (ties: the lower index). A later turn
    of a conversation starts with the earlier turns' blocks, so it follows them to their core.
    A LoRA adapter counts as one more leading block of its requests (their blocks chained
    from it, as the prefix cache keys blocks by adapter): an adapter's requests follow it to
    the core that served it, whose loaded adapters and step's distinct adapters it spares,
    within the same slack.

    Args:
        num_engines: the cores.
        block_size: tokens per KV block (only full blocks are cached, so only they count).
        capacity_blocks: blocks one core's KV cache holds.
        slack: see above, in requests.
    """

    def __init__(self, num_engines: int, block_size: int, capacity_blocks: int, slack: int = AFFINITY_SLACK) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.slack = slack
        self.loads = [0] * num_engines
        self.alive = [True] * num_engines
        self._blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_engines)]

    def route(
        self, token_ids: list[int], cache_salt: str | None = None, weight: int = 1, lora_id: int | None = None
    ) -> int:
        """The core for a request of ``weight`` engine-core requests (of LoRA adapter
        ``lora_id``, None: the base model); counts them on it.

        Raises:
            EngineDeadError: no core is alive.
        """
        live = [i for i, alive in enumerate(self.alive) if alive]
        if not live:
            raise EngineDeadError("every engine core has died")
        hashes = self._block_hashes(token_ids, cache_salt, lora_id) if len(live) > 1 else []
        least = min(live, key=lambda i: (self.loads[i], i))
        matched = {i: self._matched(i, hashes) for i in live}
        best = max(live, key=lambda i: (matched[i], -self.loads[i], -i))
        choice = best if matched[best] and self.loads[best] <= self.loads[least] + self.slack else least
        self._remember(choice, hashes)
        self.loads[choice] += weight
        return choice

    def release(self, engine: int, weight: int = 1) -> None:
        """``weight`` requests of ``engine`` finished or were aborted."""
        self.loads[engine] = max(self.loads[engine] - weight, 0)

    def mark_dead(self, engine: int) -> None:
        """Route nothing more to ``engine``."""
        self.alive[engine] = False
        self.loads[engine] = 0
        self._blocks[engine].clear()

    def _block_hashes(self, token_ids: list[int], cache_salt: str | None, lora_id: int | None) -> list[int]:
        # Chained like the prefix cache's keys: a block's hash stands for the whole prefix up to it.
        hashes, h = [], hash(cache_salt)
        if lora_id is not None:
            h = hash((h, "lora", lora_id))
            hashes.append(h)
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            h = hash((h, tuple(token_ids[start : start + self.block_size])))
            hashes.append(h)
        return hashes

    def _matched(self, engine: int, hashes: list[int]) -> int:
        blocks = self._blocks[engine]
        n = 0
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        return n

    def _remember(self, engine: int, hashes: list[int]) -> None:
        blocks = self._blocks[engine]
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)


class DPAsyncMPClient:
    """asyncio client over ``config.data_parallel_size`` engine-core processes.

    Construction starts every process; ``wait_ready`` completes every handshake; ``start()``
    must then run inside the event loop. Outputs are read per core (``get_output(i)``), so
    that one core's death ends only its own reader.

    Args:
        config: engine settings, handed to every core.

    Raises:
        ValueError: a combination ``check_data_parallel`` refuses.
    """

    def __init__(self, config: EngineConfig) -> None:
        check_data_parallel(config)
        self.cores: list[AsyncMPClient] = []
        try:
            for i in range(config.data_parallel_size):
                self.cores.append(AsyncMPClient(config, i))
        except BaseException:
            self.shutdown()
            raise
        self.router: DPRouter | None = None  # sized by the handshake
        self._owner: dict[str, int] = {}  # engine-core request id -> its core

    @property
    def pids(self) -> list[int]:
        """The cores' process ids, by engine index."""
        return [c.proc.pid for c in self.cores]

    def wait_ready(self) -> EngineCoreReady:
        """Block until every core has loaded the model; return core 0's handshake (all are alike).

        Raises:
            RuntimeError: a core failed to start (its error in the message).
        """
        readies = [c.wait_ready() for c in self.cores]
        kv = readies[0].kv_cache_config
        assert kv is not None
        self.router = DPRouter(len(self.cores), kv.block_size, kv.num_blocks)
        return readies[0]

    def start(self) -> None:
        """Attach every core to the running loop."""
        for c in self.cores:
            c.start()

    def is_alive(self, engine: int) -> bool:
        return self.router.alive[engine] and self.cores[engine].is_alive

    def add_requests(self, requests: list[EngineCoreRequest]) -> int:
        """Send the engine-core requests of one user request (same prompt) to one core; return its index.

        Raises:
            EngineDeadError: no core is alive.
        """
        for i, c in enumerate(self.cores):  # a core that has just exited, before its reader noticed
            if not c.is_alive:
                self.router.mark_dead(i)
        first = requests[0]
        lora = first.lora_request
        engine = self.router.route(first.prompt_token_ids, first.cache_salt, len(requests), lora and lora.id)
        for r in requests:
            self._owner[r.request_id] = engine
        self.cores[engine].add_requests(requests)
        return engine

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort engine-core requests on the cores that own them; unknown (finished) ids are skipped."""
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            engine = self._owner.pop(rid, None)
            if engine is not None:
                by_engine.setdefault(engine, []).append(rid)
        for engine, ids in by_engine.items():
            self.router.release(engine, len(ids))
            self.cores[engine].abort_requests(ids)

    async def get_output(self, engine: int) -> EngineCoreOutputs:
        """Core ``engine``'s next step outputs (its finished requests no longer count on it).

        Raises:
            EngineDeadError: that core's process has exited.
        """
        out = await self.cores[engine].get_output()
        for o in out.outputs:
            if o.finish_reason is not None and self._owner.pop(o.request_id, None) is not None:
                self.router.release(engine)
        return out

    def fail_core(self, engine: int) -> None:
        """Forget a dead core's requests and route nothing more to it."""
        self.router.mark_dead(engine)
        self._owner = {rid: e for rid, e in self._owner.items() if e != engine}

    async def call_utility(self, method: str, *args: Any) -> list[Any]:
        """Run an engine-core method on every live core; their results by core (dead ones left out).

        Raises:
            EngineDeadError: a core died during the call.
        """
        live = [c for i, c in enumerate(self.cores) if self.is_alive(i)]
        return list(await asyncio.gather(*(c.call_utility(method, *args) for c in live)))

    def shutdown(self) -> None:
        """Stop every core (each: SHUTDOWN, then killed if it does not stop)."""
        for c in self.cores:
            c.shutdown()
