"""The executor: the engine core's one door to the model, whatever runs it.

The engine core hands each step's scheduler output to :meth:`Executor.execute` and gets the
model runner's output back. Rank 0 of the tensor-parallel group (the driver) is a
:class:`~pagedllm.worker.worker.Worker` in this process: it owns the requests' sampling
state, sends each step to the other ranks (a diff, msgspec over a ``StepSender``), runs it
too, and alone returns tokens. Subclasses only start and stop ranks 1..N-1: as local
processes (``mp``) or as Ray actors (``ray``); at one rank (``uni``) there is nothing to start.

A rank that exits fails the next step, or the one under way, with ``WorkerDiedError``; one that
hangs fails it once the others have waited ``worker_timeout_s`` for it in a collective. Either
way the engine cannot go on. Shutdown sends every rank the shutdown message, waits for the
ranks to leave, and only then leaves the group itself.
"""

from __future__ import annotations

import atexit
import logging
import time

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.distributed.cpu_budget import cpu_share
from pagedllm.distributed.parallel_state import free_port
from pagedllm.distributed.step_channel import StepSender
from pagedllm.worker.model_runner import ModelRunnerOutput
from pagedllm.worker.worker import Worker, WorkerSpec

logger = logging.getLogger("pagedllm")

# How long shutdown waits for the other ranks to leave their loops before killing them.
_STOP_TIMEOUT_S = 10
# How long the other ranks may take to load their shards once rank 0 has loaded its own.
_READY_TIMEOUT_S = 600


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank other than the driver is gone, or hung: the model cannot run."""


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
        self.sender: StepSender | None = None
        try:
            init_method = self._start_workers() if self.tp_size > 1 else ""
        except BaseException:
            self._close_sender()
            raise
        try:
            self.driver = Worker(config, kv, 0, init_method, self._driver_cpus())
            if self.sender is not None:
                self.sender.accept(_READY_TIMEOUT_S, self._workers_alive)
        except BaseException as e:
            alive = self._workers_alive()
            if getattr(self, "driver", None) is not None:
                self.driver.close()
                self.driver = None
            self._close_sender()
            self._stop_workers(0)
            if not alive:
                raise WorkerDiedError(f"a tensor-parallel worker exited during start-up: {e}") from e
            raise
        self.model_config = self.driver.model_config
        self.runner = self.driver.runner
        if self.tp_size > 1:  # an LLM never shut down still stops its ranks before the interpreter tears down
            atexit.register(self.shutdown)

    def _open_sender(self, host: str) -> str:
        """Listen for ranks 1..N-1 on ``host``; return the group's ``tcp://host:port`` for them."""
        self.sender = StepSender(host, self.tp_size - 1)
        return f"tcp://{host}:{free_port(host)}"

    def _spec(self, rank: int, init_method: str, cpus: list[int] | None) -> bytes:
        """The encoded ``WorkerSpec`` of rank ``rank`` > 0 (after ``_open_sender``)."""
        return WorkerSpec(self.config, self.kv, rank, init_method, self.sender.address, cpus).encode()

    def _close_sender(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def _driver_cpus(self) -> list[int] | None:
        """Rank 0's cores: its share when the ranks split this machine; None at one rank."""
        return cpu_share(0, self.tp_size) if self.tp_size > 1 else None

    def _start_workers(self) -> str:
        """Start ranks 1..N-1, each running ``worker_main`` on its ``_spec``; return the group's
        ``tcp://host:port`` (from ``_open_sender``)."""
        raise NotImplementedError(f"{type(self).__name__} runs one rank")

    def _workers_alive(self) -> bool:
        return True

    def _stop_workers(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for ranks 1..N-1 to exit (rank 0 told them to), then kill them."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; the sampled tokens come from rank 0.

        Raises:
            WorkerDiedError: if another rank exited (before or during the step), or kept the
                others waiting ``worker_timeout_s`` in a collective.
            RuntimeError: after ``shutdown`` (was an AttributeError on its None driver).
        """
        if getattr(self, "driver", None) is None:
            raise RuntimeError(
                "the engine is shut down (LLM.shutdown(), or the end of its with block): no step can run; "
                "make a new LLM"
            )
        sender = self.sender
        if sender is not None and sender.dead_ranks:
            raise WorkerDiedError(f"tensor-parallel rank {sender.dead_ranks[0]} is gone")
        start = time.monotonic()
        try:
            return self.driver.execute(sched, sender)
        except RuntimeError as e:
            if sender is None:
                raise
            # A peer's exit fails the collectives at once; its connection shows it soon after.
            if sender.wait_dead(1.0) or not self._workers_alive():
                raise WorkerDiedError(f"a tensor-parallel worker died: {e}") from e
            if time.monotonic() - start >= self.config.worker_timeout_s:
                raise WorkerDiedError(
                    f"a tensor-parallel worker did not answer within worker_timeout_s={self.config.worker_timeout_s:g} s "
                    f"(hung?): {e}"
                ) from e
            raise

    def shutdown(self) -> None:
        """Stop the other ranks, then leave the group; idempotent."""
        if getattr(self, "driver", None) is None:
            return
        atexit.unregister(self.shutdown)
        if self.sender is not None:
            try:
                self.driver.stop_others(self.sender)
            except RuntimeError:
                logger.warning("could not tell the tensor-parallel workers to stop; killing them")
            self._close_sender()
        self._stop_workers(_STOP_TIMEOUT_S)
        self.driver.close()
        self.driver = None
