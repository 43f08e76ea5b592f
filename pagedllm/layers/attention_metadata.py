"""A step's attention metadata: which rows are decode queries and which prompt chunks, each
with its block table and key counts, and the slot each new token's K/V is written to. Built
once per step (per KV cache group) and shared by every attention layer of the step
(``layers.attention.PagedAttention``, the one-call decoder ``kernels.decoder``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillMeta:
    """One request with several query tokens in this step."""

    query_start: int  # first row of this request's tokens in the flattened step
    query_len: int
    seq_len: int  # context length after this step (cached + new tokens)
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64 (a row of prefill_block_tables)


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by every attention layer.

    The decode kernel's queries come first in the flattened tokens, one per row of the leading
    requests (``build``'s ``num_decode_requests``), each with its request's block table and the keys up
    to its own position; the rest (prompt chunks) take the prefill kernel.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset) per token
    num_decodes: int  # the leading rows that are decode queries
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64, padded with 0
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64: keys each decode query attends
    prefills: list[PrefillMeta]
    # The prefills for the native kernel: [P, max_blocks] int64 block tables padded with 0, and
    # [3, P] int64 rows (query_start, query_len, seq_len); None without prefills.
    prefill_block_tables: torch.Tensor | None = None
    prefill_spans: torch.Tensor | None = None
    # Masks built on first use by the PyTorch paths that need them (a later prefill chunk's
    # causal offset, a sliding window, the decode batch's padding), keyed by (prefill index or
    # -1 for the decode batch, window or 0).
    window_masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        num_decode_requests: int | None = None,
    ) -> AttentionMetadata:
        """Build the metadata for one step.

        Args:
            query_lens: new tokens per request this step.
            seq_lens: context length per request after this step (num_computed + query_len).
            block_tables: block ids per request, covering at least ``seq_len`` tokens.
            block_size: tokens per block.
            num_decode_requests: the leading requests whose rows take the decode kernel, of any
                query length: each row is a query of its own over the keys up to its position
                (``seq_len - query_len + 1 + i`` for row i), which makes a verification's or a
                recomputed output's row attend bit for bit as the decode step at its position
                did or would. The rest take the prefill kernel (a prompt's one-token chunk too,
                as its other chunks do). None: every leading request of query length 1, and no
                later one of length 1.

        Raises:
            ValueError: num_decode_requests is not a number of the step's requests, or (None) a
                request of query length 1 follows a longer one.
        """
        slots: list[int] = []
        for q, s, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(s - q, s):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        if num_decode_requests is None:
            num_decode_requests = 0
            while num_decode_requests < len(query_lens) and query_lens[num_decode_requests] == 1:
                num_decode_requests += 1
            if any(q == 1 for q in query_lens[num_decode_requests:]):
                raise ValueError("decode requests (query length 1) must come first")
        elif not 0 <= num_decode_requests <= len(query_lens):
            raise ValueError(
                f"num_decode_requests {num_decode_requests}: not a number of the step's {len(query_lens)} requests"
            )

        decode_tables = lens = None
        decode_rows = sum(query_lens[:num_decode_requests])
        if num_decode_requests:
            # One query per row: row i of a request attends its first seq_len - query_len + 1 + i keys.
            row_lens = [s - q + 1 + i for q, s in zip(query_lens[:num_decode_requests], seq_lens) for i in range(q)]
            row_tables = [t for q, t in zip(query_lens[:num_decode_requests], block_tables) for _ in range(q)]
            row_blocks = [-(-s // block_size) for s in row_lens]
            max_blocks = max(row_blocks)
            decode_tables = torch.tensor(
                [t[:n] + [0] * (max_blocks - n) for t, n in zip(row_tables, row_blocks)], dtype=torch.long
            )
            lens = torch.tensor(row_lens, dtype=torch.long)

        prefills = []
        prefill_tables = spans = None
        if num_decode_requests < len(query_lens):
            prefill_blocks = [-(-s // block_size) for s in seq_lens[num_decode_requests:]]
            width = max(prefill_blocks)
            prefill_tables = torch.tensor(
                [t[:n] + [0] * (width - n) for t, n in zip(block_tables[num_decode_requests:], prefill_blocks)],
                dtype=torch.long,
            )
            start = decode_rows
            for i, n in enumerate(prefill_blocks):
                q, s = query_lens[num_decode_requests + i], seq_lens[num_decode_requests + i]
                prefills.append(PrefillMeta(start, q, s, prefill_tables[i, :n]))
                start += q
            spans = torch.tensor([[p.query_start, p.query_len, p.seq_len] for p in prefills], dtype=torch.long).T.contiguous()
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_decodes=decode_rows,
            decode_block_tables=decode_tables,
            decode_seq_lens=lens,
            prefills=prefills,
            prefill_block_tables=prefill_tables,
            prefill_spans=spans,
        )
