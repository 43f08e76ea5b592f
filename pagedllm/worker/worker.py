"""One tensor-parallel rank: its model shard, its share of the KV cache, its model runner.

Every rank runs the same step: rank 0 (the driver, in the engine-core process) builds it from
the scheduler's output, sends it to the others and runs it (:meth:`Worker.execute`); every other
rank receives and runs it (:meth:`Worker.serve`) until rank 0 sends the shutdown message or goes
away. Those ranks start in :func:`worker_main`, whatever starts their process: the multiprocess
executor runs ``python -m pagedllm.worker.worker`` with a :class:`WorkerSpec` on stdin, the Ray
executor calls it in an actor. The spec is msgspec-encoded (no pickle), the engine config whole.
"""

from __future__ import annotations

import importlib
import logging
import sys
import time

import msgspec
import torch

from pagedllm.config import EngineConfig, parse_kv_cache_dtype
from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.distributed.cpu_budget import pin_to, restore
from pagedllm.distributed.parallel_state import SINGLE, destroy_tensor_parallel, init_tensor_parallel
from pagedllm.distributed.step_channel import StepReceiver, StepSender
from pagedllm.models.loader import load_model, resolve_model
from pagedllm.worker.lora_manager import LoRAManager
from pagedllm.worker.model_runner import ModelRunner, ModelRunnerOutput
from pagedllm.worker.step_input import StepInput, build_step

logger = logging.getLogger("pagedllm")


class WorkerSpec(msgspec.Struct):
    """What a rank > 0 needs to start (see ``Worker`` for the fields)."""

    config: EngineConfig
    kv: KVCacheConfig
    rank: int
    init_method: str
    step_channel: str  # "host:port" of rank 0's StepSender
    cpus: list[int] | None

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self, enc_hook=_enc_hook)

    @classmethod
    def decode(cls, payload: bytes) -> WorkerSpec:
        return msgspec.msgpack.decode(payload, type=cls, dec_hook=_dec_hook)


def _enc_hook(obj: object) -> object:
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(type_: type, obj: object) -> object:
    if type_ is torch.dtype:  # a name _enc_hook wrote: any engine or K/V cache dtype's
        return parse_kv_cache_dtype(obj)
    raise NotImplementedError(f"cannot decode {type_}")


def model_runner_class(name: str) -> type[ModelRunner]:
    """The ``ModelRunner`` subclass ``name`` ("module:Class") names; ``ModelRunner`` for "".

    Raises:
        ValueError: if ``name`` is not "module:Class" or names no ``ModelRunner`` subclass.
    """
    if not name:
        return ModelRunner
    module, _, attr = name.partition(":")
    cls = getattr(importlib.import_module(module), attr, None) if module and attr else None
    if not (isinstance(cls, type) and issubclass(cls, ModelRunner)):
        raise ValueError(f"model_runner_cls must name a ModelRunner subclass as module:Class, got {name!r}")
    return cls


class Worker:
    """Joins the group as ``rank``, loads the rank's shard and allocates its KV cache.

    Args:
        config: engine settings (model, dtype, quantization, tensor_parallel_size,
            worker_timeout_s, model_runner_cls).
        kv: the KV cache geometry (each rank allocates ``kv.num_kv_heads`` heads).
        rank: this rank, 0 for the driver.
        init_method: ``tcp://host:port`` of rank 0's store ("" at one rank).
        cpus: cores to pin this process to; None leaves its affinity and threads alone.
    """

    def __init__(
        self, config: EngineConfig, kv: KVCacheConfig, rank: int, init_method: str, cpus: list[int] | None
    ) -> None:
        size = config.tensor_parallel_size
        self._pinned = None if cpus is None else pin_to(cpus, f"tensor-parallel rank {rank} of {size}")
        self.tp = SINGLE
        t0 = time.perf_counter()
        try:
            self.tp = init_tensor_parallel(rank, size, init_method, collective_timeout_s=config.worker_timeout_s)
            model, self.model_config = load_model(
                resolve_model(config.model), config.dtype, config.quantization_config(), tp=self.tp,
                max_model_len=kv.max_model_len,
            )
            lora = (
                LoRAManager(model, self.model_config, config.max_lora_rank, config.max_cpu_loras, config.lora_dtype)
                if config.enable_lora else None
            )
            self.runner = model_runner_class(config.model_runner_cls)(model, self.model_config, kv, self.tp, lora)
        except BaseException:
            self.close()
            raise
        logger.info(
            "loaded %s in %.2f s (%s%s)", self.model_config.name or config.model, time.perf_counter() - t0,
            config.dtype, f", rank {rank} of {size}" if size > 1 else "",
        )
        self._encoder = msgspec.msgpack.Encoder()

    def execute(self, sched: SchedulerOutput, sender: StepSender | None) -> ModelRunnerOutput:
        """Run one step (rank 0): build it, send it to the other ranks through ``sender``
        (None at one rank), run it, sample."""
        step, plan = build_step(sched)
        if sender is not None:
            start = time.perf_counter()
            payload = self._encoder.encode(step)
            sender.send(payload)
            self.tp.stats.add("step", start, len(payload))
        self.runner.start_masks(plan)  # the grammar masks fill while the forward pass runs
        return self.runner.sample(sched, plan, self.runner.forward(step))

    def stop_others(self, sender: StepSender) -> None:
        """Send the other ranks the shutdown message (rank 0)."""
        sender.send(self._encoder.encode(StepInput(shutdown=True)))

    def serve(self, receiver: StepReceiver) -> None:
        """Run rank 0's steps (a rank > 0) until the shutdown message, or until rank 0 is gone."""
        decoder = msgspec.msgpack.Decoder(StepInput)
        receiver.ready()
        while (payload := receiver.recv()) is not None:
            step = decoder.decode(payload)
            if step.shutdown:
                return
            self.runner.forward(step)
        logger.info("rank 0 closed the connection without the shutdown message; leaving")

    def close(self) -> None:
        """Leave the group and hand the process's cores back."""
        destroy_tensor_parallel(self.tp)
        if self._pinned is not None:
            restore(self._pinned)
            self._pinned = None


def worker_main(payload: bytes) -> None:
    """A rank > 0 from its msgpack-encoded ``WorkerSpec``: join, load, run rank 0's steps, leave."""
    spec = WorkerSpec.decode(payload)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s Worker rank {spec.rank}: %(message)s")
    torch.set_grad_enabled(False)
    receiver = StepReceiver(spec.step_channel, spec.rank)
    try:
        worker = Worker(spec.config, spec.kv, spec.rank, spec.init_method, spec.cpus)
        try:
            worker.serve(receiver)
        finally:
            worker.close()
    finally:
        receiver.close()


def main() -> None:
    """``python -m pagedllm.worker.worker``: the ``WorkerSpec`` on stdin."""
    worker_main(sys.stdin.buffer.read())


if __name__ == "__main__":
    main()
