"""The executor: the engine core's one door to the model, whatever runs it.

The engine core hands each step's scheduler output to :meth:`Executor.execute` and gets the
model runner's output back. Rank 0 of the tensor-parallel group (the driver) is a
:class:`~pagedllm.worker.worker.Worker` in this process: it owns the requests' sampling
state, broadcasts each step to the other ranks (a diff, msgspec over torch.distributed) and
alone returns tokens. Subclasses only start and stop ranks 1..N-1: as local processes
(``mp``) or as Ray actors (``ray``); at one rank (``uni``) there is nothing to start.
"""

from __future__ import annotations

import logging

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.distributed.cpu_budget import cpu_share
from pagedllm.worker.model_runner import ModelRunnerOutput
from pagedllm.worker.worker import Worker

logger = logging.getLogger("pagedllm")

# How long shutdown waits for the other ranks to leave their loops before killing them.
_STOP_TIMEOUT_S = 10


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank other than the driver is gone: the model cannot run."""


class Executor:
    """Runs the model on ``config.tensor_parallel_size`` ranks; rank 0 in this process.

    Args:
        config: engine settings.
        kv: the KV cache geometry every rank allocates its share of.

    Raises:
        ValueError: from loading the model (see ``load_model``).
        WorkerDiedError: if another rank failed to start.
    """

    def __init__(self, config: EngineConfig, kv: KVCacheConfig) -> None:
        self.config = config
        self.kv = kv
        self.tp_size = config.tensor_parallel_size
        init_method = self._start_workers() if self.tp_size > 1 else ""
        try:
            self.driver = Worker(config, kv, 0, init_method, self._driver_cpus())
        except BaseException as e:
            alive = self._workers_alive()
            self._stop_workers(0)
            if not alive:
                raise WorkerDiedError(f"a tensor-parallel worker exited during start-up: {e}") from e
            raise
        self.model_config = self.driver.model_config
        self.runner = self.driver.runner

    def _driver_cpus(self) -> list[int] | None:
        """Rank 0's cores: its share when the ranks split this machine; None at one rank."""
        return cpu_share(0, self.tp_size) if self.tp_size > 1 else None

    def _start_workers(self) -> str:
        """Start ranks 1..N-1, each running ``run_worker``; return rank 0's ``tcp://host:port``."""
        raise NotImplementedError(f"{type(self).__name__} runs one rank")

    def _workers_alive(self) -> bool:
        return True

    def _stop_workers(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for ranks 1..N-1 to exit (rank 0 told them to), then kill them."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; the sampled tokens come from rank 0.

        Raises:
            WorkerDiedError: if another rank died (its peers' collectives then fail).
        """
        try:
            return self.runner.execute(sched)
        except RuntimeError as e:
            if not self._workers_alive():
                raise WorkerDiedError(f"a tensor-parallel worker died: {e}") from e
            raise

    def shutdown(self) -> None:
        """Stop the other ranks, then leave the group; idempotent."""
        if getattr(self, "driver", None) is None:
            return
        if self._workers_alive():
            try:
                self.runner.stop_remote()
            except RuntimeError:
                logger.warning("could not tell the tensor-parallel workers to stop; killing them")
        self._stop_workers(_STOP_TIMEOUT_S)
        self.driver.close()
        self.driver = None


def create_executor(config: EngineConfig, kv: KVCacheConfig) -> Executor:
    """The executor ``config.distributed_executor_backend`` names ("uni", "mp" or "ray").

    Raises:
        ImportError: for "ray" without the ``ray`` package (install ``pagedllm[ray]``).
    """
    backend = config.distributed_executor_backend
    if backend == "mp":
        from pagedllm.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config, kv)
    if backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(config, kv)
    return Executor(config, kv)
