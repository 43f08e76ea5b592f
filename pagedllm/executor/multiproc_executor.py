"""Ranks 1..N-1 as local processes, each pinned to its share of this machine's cores.

Each worker is a fresh ``python -m pagedllm.worker.worker`` process (not a multiprocessing
child: the engine-core process is daemonic and may not have any) reading its
:class:`~pagedllm.worker.worker.WorkerSpec` from stdin. The group meets on loopback; a
worker whose driver dies sees its step connection close and exits.
"""

from __future__ import annotations

import subprocess
import sys

from pagedllm.distributed.cpu_budget import cpu_share
from pagedllm.executor.executor import Executor


class MultiprocExecutor(Executor):
    """Tensor parallelism over ``tensor_parallel_size`` processes of this machine."""

    procs: list[subprocess.Popen] = []

    def _start_workers(self) -> str:
        init_method = self._open_sender("127.0.0.1")
        self.procs = []
        for rank in range(1, self.tp_size):
            proc = subprocess.Popen([sys.executable, "-m", "pagedllm.worker.worker"], stdin=subprocess.PIPE)
            proc.stdin.write(self._spec(rank, init_method, cpu_share(rank, self.tp_size)))
            proc.stdin.close()
            self.procs.append(proc)
        return init_method

    def _workers_alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def _stop_workers(self, timeout_s: float) -> None:
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
