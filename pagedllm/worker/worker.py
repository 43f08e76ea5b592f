"""One tensor-parallel rank: its model shard, its share of the KV cache, its model runner.

Rank 0 (the driver) lives in the engine-core process and is stepped by the executor; every
other rank runs :func:`run_worker`, a loop over the steps rank 0 broadcasts. The multiprocess
executor starts those as ``python -m pagedllm.worker.worker`` with a msgspec-encoded
:class:`WorkerSpec` on stdin (no pickle; a fresh interpreter, so no forked threads).
"""

from __future__ import annotations

import logging
import sys
import time

import msgspec
import torch

from pagedllm.config import EngineConfig, parse_dtype
from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.distributed.cpu_budget import pin_to, restore
from pagedllm.distributed.parallel_state import SINGLE, destroy_tensor_parallel, init_tensor_parallel
from pagedllm.models.loader import load_model, resolve_model
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")


class Worker:
    """Joins the group as ``rank``, loads the rank's shard and allocates its KV cache.

    Args:
        config: engine settings (model, dtype, quantization, tensor_parallel_size).
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
            self.tp = init_tensor_parallel(rank, size, init_method)
            model, self.model_config = load_model(
                resolve_model(config.model), config.dtype, config.quantization_config(), tp=self.tp
            )
        except BaseException:
            self.close()
            raise
        logger.info(
            "loaded %s in %.2f s (%s%s)", self.model_config.name or config.model, time.perf_counter() - t0,
            config.dtype, f", rank {rank} of {size}" if size > 1 else "",
        )
        self.runner = ModelRunner(model, self.model_config, kv, self.tp)

    def close(self) -> None:
        """Leave the group and hand the process's cores back."""
        destroy_tensor_parallel(self.tp)
        if self._pinned is not None:
            restore(self._pinned)
            self._pinned = None


def run_worker(config: EngineConfig, kv: KVCacheConfig, rank: int, init_method: str, cpus: list[int] | None) -> None:
    """Rank ``rank`` (> 0): join the group, load, then run rank 0's steps until it says stop."""
    worker = Worker(config, kv, rank, init_method, cpus)
    try:
        while worker.runner.execute_remote():
            pass
    finally:
        worker.close()


class WorkerSpec(msgspec.Struct):
    """What a worker process needs, sent on its stdin by the multiprocess executor."""

    model: str
    dtype: str
    quantization: str
    quantization_group_size: int
    quantize_lm_head: bool
    requantize_4bit: bool
    tensor_parallel_size: int
    kv: KVCacheConfig
    rank: int
    init_method: str
    cpus: list[int] | None

    @classmethod
    def of(cls, config: EngineConfig, kv: KVCacheConfig, rank: int, init_method: str, cpus: list[int] | None) -> WorkerSpec:
        return cls(
            config.model, str(config.dtype).removeprefix("torch."), config.quantization,
            config.quantization_group_size, config.quantize_lm_head, config.requantize_4bit,
            config.tensor_parallel_size, kv, rank, init_method, cpus,
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, dtype=parse_dtype(self.dtype), quantization=self.quantization,
            quantization_group_size=self.quantization_group_size, quantize_lm_head=self.quantize_lm_head,
            requantize_4bit=self.requantize_4bit, tensor_parallel_size=self.tensor_parallel_size,
        )


def main() -> None:
    spec = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=WorkerSpec)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s Worker rank {spec.rank}: %(message)s")
    torch.set_grad_enabled(False)
    run_worker(spec.engine_config(), spec.kv, spec.rank, spec.init_method, spec.cpus)


if __name__ == "__main__":
    main()
