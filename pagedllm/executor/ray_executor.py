"""Tensor-parallel ranks as Ray actors, placed on a (possibly multi-node) Ray cluster.

Rank 0 stays in the engine-core process (the driver); ranks 1..N-1 are actors, one per
bundle of a placement group whose bundle 0 is pinned to the driver's node, so every rank has a
reservation and the group's strategy (``ray_placement_strategy``) decides how ranks spread.
Each actor runs ``worker_main``, as the multiprocess executor's processes do, and the ranks talk
exactly as theirs do: Ray only places and starts them, and reports an actor's death (its
blocking ``run`` call returns).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import site
import socket
import threading
from collections import defaultdict
from types import ModuleType
from typing import Any

import pagedllm
from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.distributed.cpu_budget import cpu_share
from pagedllm.executor.executor import Executor
from pagedllm.worker.worker import worker_main

logger = logging.getLogger("pagedllm")

PLACEMENT_TIMEOUT_S = 60.0  # a group that cannot be placed by then is reported, not waited on
ACTOR_START_TIMEOUT_S = 120.0  # actor processes up and pagedllm imported (before rank 0 blocks in the group)
LOCAL_OBJECT_STORE_BYTES = 128 * 1024**2  # only start-up arguments pass through it
# Forwarded to the actors when set here: gloo then binds the interface the user chose.
_FORWARDED_ENV = ("GLOO_SOCKET_IFNAME",)


def import_ray() -> ModuleType:
    """The ``ray`` package.

    Raises:
        ImportError: when it is not installed, saying how to install it.
    """
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "distributed_executor_backend='ray' needs the ray package: pip install 'pagedllm[ray]'"
        ) from e
    return ray


def bundle_cpus(strategy: str, node_cpus: list[float], num_bundles: int) -> float:
    """CPUs each of ``num_bundles`` equal bundles claims: one, or the equal share that fits.

    A share below one core still runs (ranks then share cores, as ``cpu_share`` does); the
    claim only keeps Ray from scheduling other work on the ranks' cores.

    Args:
        strategy: the placement strategy; STRICT_PACK puts every bundle on ``node_cpus[0]``.
        node_cpus: CPUs of each alive node, the driver's node first.
    """
    room = node_cpus[0] if strategy == "STRICT_PACK" else sum(node_cpus)
    return min(1.0, math.floor(room / num_bundles * 1e4) / 1e4)  # Ray's resource granularity


def host_shares(hosts: list[str]) -> list[tuple[int, int]]:
    """Per rank, (its index among the ranks on its host, how many ranks that host runs).

    Keyed by host address, not Ray node: several raylets on one machine (a test cluster)
    still share its cores.
    """
    seen: dict[str, int] = defaultdict(int)
    shares = []
    for host in hosts:
        shares.append((seen[host], hosts.count(host)))
        seen[host] += 1
    return shares


class _Rank:
    """The actor body of one rank > 0."""

    def host_cpus(self) -> list[int]:
        """The cores this actor's process may use (Ray leaves affinity alone: its host's)."""
        return sorted(os.sched_getaffinity(0))

    def run(self, spec: bytes) -> None:
        """``worker_main`` of the rank a msgpack-encoded ``WorkerSpec`` describes."""
        worker_main(spec)


class RayExecutor(Executor):
    """Ranks 1..N-1 as Ray actors in a placement group with one bundle per rank.

    Connects to a running cluster (``ray.init(address="auto")``, or the session this process
    already initialized), else starts a local one and stops it again at shutdown.

    Raises:
        ImportError: when ray is not installed.
        RuntimeError: when the placement group cannot be placed within ``PLACEMENT_TIMEOUT_S``
            or an actor does not start within ``ACTOR_START_TIMEOUT_S``.
    """

    def __init__(self, config: EngineConfig, kv: KVCacheConfig) -> None:
        self._ray = import_ray()
        self._owns_cluster = False
        self._placement: Any = None
        self._actors: list[Any] = []
        self._runs: list[Any] = []
        self._rank0_cpus: list[int] | None = None
        self.bundle_nodes: list[str] = []  # the Ray node id of each rank
        super().__init__(config, kv)

    def _driver_cpus(self) -> list[int] | None:
        return self._rank0_cpus

    def _start_workers(self) -> str:
        try:
            self._owns_cluster = _connect(self._ray)
            bundle_cpu, hosts = self._place()
            host_cpus = [sorted(os.sched_getaffinity(0))] + self._start_actors(bundle_cpu)
        except BaseException:
            self._release()
            raise
        cpus = [cpu_share(index, count, host_cpus[rank]) for rank, (index, count) in enumerate(host_shares(hosts))]
        for rank, node in enumerate(self.bundle_nodes):
            logger.info(
                "tensor-parallel rank %d: %s on Ray node %s (%s), cores %s (%g CPU reserved)",
                rank, "driver" if rank == 0 else "actor", node[:8], hosts[rank], cpus[rank], bundle_cpu,
            )
        self._rank0_cpus = cpus[0]
        init_method = self._open_sender(self._ray.util.get_node_ip_address())
        self._runs = [
            actor.run.remote(self._spec(rank, init_method, cpus[rank])) for rank, actor in enumerate(self._actors, start=1)
        ]
        return init_method

    def _place(self) -> tuple[float, list[str]]:
        """Reserve one bundle per rank, bundle 0 on this (the driver's) node.

        Returns:
            The CPUs each bundle holds, and each rank's host address.
        """
        from ray.util.placement_group import placement_group, placement_group_table

        ray = self._ray
        n, strategy = self.config.tensor_parallel_size, self.config.ray_placement_strategy
        driver_node = ray.get_runtime_context().get_node_id()
        nodes = {node["NodeID"]: node for node in ray.nodes() if node["Alive"]}
        node_cpus = [nodes[driver_node]["Resources"].get("CPU", 0.0)]
        node_cpus += [node["Resources"].get("CPU", 0.0) for node_id, node in nodes.items() if node_id != driver_node]
        bundle = {"CPU": bundle_cpus(strategy, node_cpus, n)}
        self._placement = placement_group(
            [bundle] * n, strategy=strategy, bundle_label_selector=[{"ray.io/node-id": driver_node}] + [{}] * (n - 1)
        )
        if not self._placement.wait(PLACEMENT_TIMEOUT_S):
            raise RuntimeError(
                f"Ray could not place {n} bundles of {bundle} ({strategy}, the first on the driver's node) within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.available_resources()} free on {len(nodes)} "
                "node(s): add nodes or CPUs, or choose ray_placement_strategy PACK or SPREAD"
            )
        bundles_to_node = placement_group_table(self._placement)["bundles_to_node_id"]
        self.bundle_nodes = [bundles_to_node[rank] for rank in range(n)]
        return bundle["CPU"], [nodes[node]["NodeManagerAddress"] for node in self.bundle_nodes]

    def _start_actors(self, bundle_cpu: float) -> list[list[int]]:
        """Start an actor in each bundle but the driver's; wait until each runs and has imported
        pagedllm (before rank 0 blocks in the group waiting for them).

        Returns:
            The cores each actor's host lets it use, by rank from 1.
        """
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        actor_class = ray.remote(_Rank)
        self._actors = [
            actor_class.options(
                num_cpus=bundle_cpu,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement, placement_group_bundle_index=rank),
                runtime_env={"env_vars": _actor_env()},
            ).remote()
            for rank in range(1, self.config.tensor_parallel_size)
        ]
        try:
            return ray.get([actor.host_cpus.remote() for actor in self._actors], timeout=ACTOR_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as e:
            raise RuntimeError(f"Ray actors did not start within {ACTOR_START_TIMEOUT_S:.0f} s") from e

    def _workers_alive(self) -> bool:
        if not self._runs:
            return True
        done, _ = self._ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        return not done

    def _stop_workers(self, timeout_s: float) -> None:
        if self._runs:
            done, _ = self._ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout_s)
            for rank, run in enumerate(self._runs, start=1):
                if run not in done:
                    logger.warning("tensor-parallel rank %d did not stop within %.0f s: killed", rank, timeout_s)
                    continue
                try:
                    self._ray.get(run)
                except Exception as e:  # a rank that failed: the driver already failed too; say why
                    logger.warning("tensor-parallel rank %d failed: %s", rank, e)
        self._release()

    def _release(self) -> None:
        """Kill the actors and free their bundles: stop the cluster this executor started (which
        frees everything, and needs no answer from its GCS: a signal to the process group may
        have stopped it already), else remove the placement group."""
        ray = self._ray
        for actor in self._actors:
            ray.kill(actor)  # an actor that returned from run still holds a process and its bundle
        self._actors, self._runs = [], []
        if self._owns_cluster:
            ray.shutdown()
            self._owns_cluster = False
        elif self._placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement)
        self._placement = None


def _connect(ray: ModuleType) -> bool:
    """Join this process's Ray session, the running cluster ``ray.init(address="auto")`` finds,
    or a new local one.

    Returns:
        True when this call started the local cluster (the executor then stops it).

    Raises:
        RuntimeError: when ``RAY_ADDRESS`` names a cluster that does not answer.
    """
    if ray.is_initialized():
        logger.info("Ray: using this process's session (cluster at %s)", ray.get_runtime_context().gcs_address)
        return False
    from ray._private.services import canonicalize_bootstrap_address

    try:  # what address="auto" resolves to: RAY_ADDRESS, else the last `ray start` on this host
        address = canonicalize_bootstrap_address("auto")
    except ConnectionError:
        address = None
    if address is not None and not _answers(address):
        # ray.init would retry a dead address for minutes; a crashed cluster leaves its file behind
        if os.environ.get("RAY_ADDRESS"):
            raise RuntimeError(f"RAY_ADDRESS={os.environ['RAY_ADDRESS']}: no Ray cluster answers at {address}")
        logger.warning("Ray: the last cluster started on this host (%s) is gone", address)
        address = None
    # ray.init makes SIGTERM exit the process; keep the handler this process chose (the engine-core
    # process ignores SIGTERM: its front end stops it, and then the executor releases the actors).
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        if address is not None:
            ray.init(address=address)
            logger.info("Ray: connected to the running cluster at %s", address)
            return False
        ray.init(
            address="local", include_dashboard=False, log_to_driver=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES
        )
        logger.info("Ray: no running cluster found, started a local one (%s)", ray.cluster_resources())
        return True
    finally:
        if sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, sigterm)


def _answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def _actor_env() -> dict[str, str]:
    """Environment for the actors: a checkout's pagedllm (this process's) first on PYTHONPATH,
    so they run the same code, not whatever the cluster's Python has installed; the path must
    hold the same checkout on every node (shared or synced), as the model file must."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(pagedllm.__file__)))
    if root in site.getsitepackages():  # installed, not a checkout: the nodes' own install
        root = ""
    env = {name: os.environ[name] for name in _FORWARDED_ENV if name in os.environ}
    if path := os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p):
        env["PYTHONPATH"] = path
    return env

