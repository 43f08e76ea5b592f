"""A tensor-parallel rank's view of its group: rank, size and the collectives the model needs.

The group is torch.distributed's default one (gloo on CPU; the same calls run on NCCL), set
up by :func:`init_tensor_parallel` in every rank's process. Models take a :class:`TPGroup`
argument instead of reading globals, so a draft model in the same process stays whole.
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout


@dataclass
class CommStats:
    """This rank's totals per collective ("all_reduce", "gather"; "step": rank 0's step messages): calls,
    seconds spent in them (waiting for peers included), payload bytes this rank passed in."""

    calls: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, op: str, start: float, nbytes: int) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        self.seconds[op] = self.seconds.get(op, 0.0) + time.perf_counter() - start
        self.bytes[op] = self.bytes.get(op, 0) + nbytes


@dataclass(frozen=True)
class TPGroup:
    """One rank of a tensor-parallel group (size 1: no group, every collective a no-op)."""

    rank: int = 0
    size: int = 1
    stats: CommStats = field(default_factory=CommStats, compare=False, repr=False)

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules, samples and returns tokens; the others only compute."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        return self._all_reduce(x, dist.ReduceOp.SUM)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``x`` over the ranks, in place; returns ``x``."""
        return self._all_reduce(x, dist.ReduceOp.MAX)

    def _all_reduce(self, x: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        if self.size > 1:
            start = time.perf_counter()
            dist.all_reduce(x, op=op)
            self.stats.add("all_reduce", start, x.nbytes)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` (same shape on each) along the last dim, on rank 0.

        Returns:
            [..., size * x.shape[-1]] on rank 0, None on the others (``x`` itself at size 1).
        """
        if self.size == 1:
            return x
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        self.stats.add("gather", start, x.nbytes)
        return torch.cat(parts, dim=-1) if parts is not None else None


SINGLE = TPGroup()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for a server that binds it next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_tensor_parallel(
    rank: int, size: int, init_method: str, timeout_s: float = 300, collective_timeout_s: float | None = None
) -> TPGroup:
    """Join the default torch.distributed group (gloo) as ``rank`` of ``size``.

    Args:
        init_method: ``tcp://host:port`` of rank 0's store.
        timeout_s: how long to wait for every rank to join.
        collective_timeout_s: then, how long a collective waits for the other ranks (a hung
            rank); None: ``timeout_s``.

    Raises:
        RuntimeError: (torch.distributed's) if the group does not form within ``timeout_s``;
            later, from a collective that a peer leaves (at once) or keeps waiting (after
            ``collective_timeout_s``).
    """
    if size == 1:
        return SINGLE
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    if collective_timeout_s is not None:
        _set_pg_timeout(datetime.timedelta(seconds=collective_timeout_s))
    return TPGroup(rank, size)


def destroy_tensor_parallel(tp: TPGroup) -> None:
    """Leave the group (rank 0 last, or the others' collectives would hang until the timeout)."""
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
