"""The executor a configuration names: the one module that knows every executor class.

Its own module so that ``executor.py`` (the base class, which runs one rank alone) does not
import its subclasses' modules, which import it. ``ray`` itself is imported only when a Ray
executor starts.
"""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.executor.executor import Executor
from pagedllm.executor.multiproc_executor import MultiprocExecutor
from pagedllm.executor.ray_executor import RayExecutor


def create_executor(config: EngineConfig, kv: KVCacheConfig) -> Executor:
    """The executor ``config.distributed_executor_backend`` names ("uni", "mp" or "ray").

    Raises:
        ImportError: for "ray" without the ``ray`` package (install ``pagedllm[ray]``).
    """
    backend = config.distributed_executor_backend
    if backend == "mp":
        return MultiprocExecutor(config, kv)
    if backend == "ray":
        return RayExecutor(config, kv)
    return Executor(config, kv)
