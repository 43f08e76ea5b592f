"""The fake model of ``test_scheduler_fuzz.py``, whose K/V cache is exact.

The fake K/V cache holds, per KV cache group, one entry per slot (block id * block_size +
offset): the position written there and a hash of the whole token history up to and including
it, which is what a real model's K/V at that position depends on. Each step the fake model
builds the step as rank 0 does (``build_step``), applies it to a ``BlockTableMirror`` through a
msgpack round trip, writes every scheduled token through the worker's slot mappings
(``build_attention_metadata``), then reads back, through the same block tables attention reads,
every position each query can see: the whole context in a global group, the last ``window``
positions before the step's first query in a sliding-window group. A prefix-cache hit on a
wrong block, a block reused while still held, a preemption that recomputes into the wrong
slots or a window group that releases a block still in the window reads back a wrong entry.
The next token is a hash of the history read back, taken from the step's logits rows as the
model runner takes them (EOS and stop tokens among the small vocabulary), and draft tokens are
verified against it; ``oracle_continuation`` gives the tokens it will produce (correct drafts).

Test modules import from here, never from one another.
"""

from __future__ import annotations

import itertools

import msgspec

from pagedllm.core.kv_cache_groups import KVCacheGroup
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.worker.kv_cache import build_attention_metadata
from pagedllm.worker.step_input import BlockTableMirror, StepInput, build_step, forward_order

VOCAB = 24
_MOD = (1 << 61) - 1


def _extend(h: int, token: int) -> int:
    """The history hash after one more token."""
    return (h * 1_000_003 + token + 7) % _MOD


def _next_token(h: int) -> int:
    """The fake model's greedy token after a history of hash ``h``."""
    return (h * 0x9E3779B97F4A7C15 >> 17) % VOCAB


class History:
    """Hashes of a request's token prefixes: ``of(tokens)[p]`` covers ``tokens[: p + 1]``;
    ``seed``: the LoRA adapter's id (another adapter, other K/V), 0 for the base model."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.tokens: list[int] = []
        self.hashes: list[int] = []

    def of(self, tokens: list[int]) -> list[int]:
        n = 0
        while n < min(len(tokens), len(self.tokens)) and tokens[n] == self.tokens[n]:
            n += 1
        del self.tokens[n:], self.hashes[n:]
        for t in tokens[n:]:
            self.hashes.append(_extend(self.hashes[-1] if self.hashes else self.seed, t))
            self.tokens.append(t)
        return self.hashes


class FakeModel:
    """Runs steps against an exact fake K/V cache (see the module docstring)."""

    def __init__(self, groups: list[KVCacheGroup], num_layers: int, num_blocks: int, block_size: int) -> None:
        self.groups = groups
        self.num_layers = num_layers
        self.block_size = block_size
        self.cache: list[list[tuple[int, int] | None]] = [[None] * (num_blocks * block_size) for _ in groups]
        self.mirror = BlockTableMirror(len(groups))
        self.decoder = msgspec.msgpack.Decoder(StepInput)
        self.histories: dict[str, History] = {}
        self.scored: dict[str, list[int]] = {}  # prompt positions scored, per request

    def run(self, sched: Scheduler, out: SchedulerOutput) -> list[list[int]]:
        """The tokens each scheduled request accepts this step (the engine's ``sampled``)."""
        step, plan = build_step(out)
        self.mirror.apply(self.decoder.decode(msgspec.msgpack.encode(step)))
        bs = self.block_size
        expected: list[list[int]] = []  # per step request: its history hashes up to the step's end
        for r, s in zip(step.requests, [out.scheduled[i] for i in forward_order(out)]):
            request = s.request
            assert r.req_id == request.request_id and r.num_computed_before == s.num_computed_before
            known = request.all_token_ids[: s.num_computed_before + s.num_new_tokens - len(s.spec_token_ids)]
            assert r.token_ids == known[s.num_computed_before :] + s.spec_token_ids
            assert self.mirror[r.req_id] == sched.kv_cache.block_ids(r.req_id)
            history = self.histories.setdefault(r.req_id, History(adapter_id(request)))
            expected.append(list(history.of(known + s.spec_token_ids)))
        query_lens = [len(r.token_ids) for r in step.requests]
        seq_lens = [r.num_computed_before + len(r.token_ids) for r in step.requests]
        metas = build_attention_metadata(
            self.groups, self.num_layers, query_lens, seq_lens, [self.mirror[r.req_id] for r in step.requests], bs,
            step.num_decode_requests,
        )
        for g, group in enumerate(self.groups):  # every layer writes the step's K/V, then attends
            meta = metas[group.layers[0]]
            slots = meta.slot_mapping.tolist()
            t = 0
            for r, hashes in zip(step.requests, expected):
                for p in range(r.num_computed_before, r.num_computed_before + len(r.token_ids)):
                    self.cache[g][slots[t]] = (p, hashes[p])
                    t += 1
            assert t == len(slots)
        hidden: list[int] = []  # per token of the step, the history hash its query read back last
        first_rows = list(itertools.accumulate(query_lens, initial=0))
        for j, (r, hashes) in enumerate(zip(step.requests, expected)):
            seen: dict[int, int] = {}
            for g, group in enumerate(self.groups):
                meta = metas[group.layers[0]]
                if j < step.num_decode_requests:  # a decode query per row, each over the keys up to its position
                    rows = range(first_rows[j], first_rows[j] + query_lens[j])
                    assert meta.decode_seq_lens[rows.start : rows.stop].tolist() == list(
                        range(seq_lens[j] - query_lens[j] + 1, seq_lens[j] + 1)
                    )
                    table = meta.decode_block_tables[rows.stop - 1].tolist()
                else:
                    table = meta.prefills[j - step.num_decode_requests].block_ids.tolist()
                held = sched.kv_cache.req_blocks[r.req_id][g]
                first = r.num_computed_before
                lo = max(0, first - group.window + 1) if group.window else 0
                for p in range(lo, seq_lens[j]):
                    assert held[p // bs] is not None, f"{r.req_id}: group {g} position {p} released but in the window"
                    entry = self.cache[g][table[p // bs] * bs + p % bs]
                    assert entry == (p, hashes[p]), f"{r.req_id}: group {g} position {p} reads {entry}"
                    if p >= first:
                        seen[p] = entry[1]
            hidden += [seen[p] for p in range(r.num_computed_before, seq_lens[j])]
        # The logits rows as the model runner takes them: the sampled rows, the verified ones,
        # then the prompt-logprob rows; each must be the row of the token the plan says.
        logits = [hidden[row] for row in step.logit_rows]
        first_row = {}  # scheduler index -> the step row of its first token
        offset = 0
        for i, n in zip(forward_order(out), query_lens):
            first_row[i] = offset
            offset += n
        sampled: list[list[int]] = [[] for _ in out.scheduled]
        for j, (i, s) in enumerate(plan.sample):
            assert s is out.scheduled[i] and s.samples and not s.spec_token_ids
            assert step.logit_rows[j] == first_row[i] + s.num_new_tokens - 1
            sampled[i] = [_next_token(logits[j])]
        for i, s, first in plan.verify:
            k = len(s.spec_token_ids)
            base = plan.num_sample + first
            assert s is out.scheduled[i] and k
            last = first_row[i] + s.num_new_tokens - 1  # the row of the last draft
            assert step.logit_rows[base : base + k + 1] == list(range(last - k, last + 1))
            tokens = []
            for t, draft in enumerate(s.spec_token_ids):
                tokens.append(_next_token(logits[base + t]))
                if draft != tokens[-1]:
                    break
            else:
                tokens.append(_next_token(logits[base + k]))
            sampled[i] = tokens
        assert {i for i, _ in plan.sample} | {i for i, _, _ in plan.verify} == {
            i for i, s in enumerate(out.scheduled) if s.samples
        }
        base = plan.num_sample + plan.num_verify
        for i, s, first, position, rows in plan.prompt:
            row = first_row[i] + position - s.num_computed_before
            assert step.logit_rows[base + first : base + first + rows] == list(range(row, row + rows))
            self.scored.setdefault(s.request.request_id, []).extend(range(position, position + rows))
        assert len(step.logit_rows) == base + sum(rows for *_, rows in plan.prompt)
        return sampled


def adapter_id(request: Request) -> int:
    """The id of the request's LoRA adapter, 0 for the base model: its histories' seed."""
    return 0 if request.lora_request is None else request.lora_request.id


def oracle_continuation(request: Request, n: int) -> list[int]:
    """The fake model's next ``n`` tokens after the request's tokens (correct drafts)."""
    h = adapter_id(request)
    history = request.all_token_ids
    for t in history:
        h = _extend(h, t)
    tokens = []
    for _ in range(n):
        t = _next_token(h)
        tokens.append(t)
        h = _extend(h, t)
    return tokens
