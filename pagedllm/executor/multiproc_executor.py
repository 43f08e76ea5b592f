"""Ranks 1..N-1 as local processes, each pinned to its share of this machine's cores.

Each worker is a fresh ``python -m pagedllm.worker.worker`` process (not a multiprocessing
child: the engine-core process is daemonic and may not have any) reading its
:class:`~pagedllm.worker.worker.WorkerSpec` from stdin. The group meets on a free loopback
port; a worker whose driver dies sees its collectives fail and exits.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import msgspec

from pagedllm.distributed.cpu_budget import cpu_share
from pagedllm.executor.executor import Executor
from pagedllm.worker.worker import WorkerSpec


class MultiprocExecutor(Executor):
    """Tensor parallelism over ``tensor_parallel_size`` processes of this machine."""

    procs: list[subprocess.Popen] = []

    def _start_workers(self) -> str:
        with socket.socket() as s:  # a free port for rank 0's store (released just before it binds)
            s.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        self.procs = []
        for rank in range(1, self.tp_size):
            spec = WorkerSpec.of(self.config, self.kv, rank, init_method, cpu_share(rank, self.tp_size))
            proc = subprocess.Popen([sys.executable, "-m", "pagedllm.worker.worker"], stdin=subprocess.PIPE)
            proc.stdin.write(msgspec.msgpack.encode(spec))
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
