"""Splitting this machine's cores between processes that compute side by side.

N tensor-parallel ranks or N data-parallel engine cores on one machine would each start as
many OpenMP threads as there are cores: N times oversubscribed, every barrier then waits on
a descheduled thread. Each process instead takes its own contiguous share of the cores the
parent may use, pins itself there (``sched_setaffinity``) and runs that many torch threads.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("pagedllm")


def cpu_share(index: int, num_shares: int, cpus: list[int] | None = None) -> list[int]:
    """The cores of share ``index`` of ``num_shares`` (of ``cpus``, default: this process's).

    Shares differ by at most one core; with fewer cores than shares, shares reuse cores
    round-robin (one each).
    """
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    if num_shares >= len(cpus):
        return [cpus[index % len(cpus)]]
    base, extra = divmod(len(cpus), num_shares)
    start = index * base + min(index, extra)
    return cpus[start : start + base + (index < extra)]


def pin_to(cpus: list[int], what: str) -> tuple[set[int], int]:
    """Pin this process to ``cpus`` and run one torch thread per core; log it.

    Returns:
        The previous (affinity, torch thread count), for :func:`restore`.
    """
    previous = (os.sched_getaffinity(0), torch.get_num_threads())
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    logger.info("%s: pinned to cores %s, %d torch threads", what, cpus, len(cpus))
    return previous


def restore(previous: tuple[set[int], int]) -> None:
    """Undo :func:`pin_to` (an in-process driver rank hands its process back as it found it)."""
    os.sched_setaffinity(0, previous[0])
    torch.set_num_threads(previous[1])
