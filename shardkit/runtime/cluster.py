"""Running independent jobs on a Ray cluster: each job one Ray task, spread across nodes.

Ray is an optional extra: it is imported inside these functions only (`check_ray` fails fast, in
one line, when it is missing). Results come back as they finish, each with the index of its job,
as `runtime.pools.map_local` yields them.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from ..core.errors import ShardkitError, WorkerDiedError, describe, require
from .stops import STOP_SIGNALS

Result = TypeVar("Result")


def check_ray() -> None:
    """Fail fast, in one line, when the ray extra is missing."""
    require("ray", "ray")


def _on_ray_node(function: Callable[[Any], Result], job: Any) -> tuple[str, Result]:
    """Runs in a Ray worker: the job's result and the id of the node that ran it."""
    import ray

    return ray.get_runtime_context().get_node_id(), function(job)


def connect_ray(address: str | None = None) -> bool:
    """Connect to the Ray cluster at `address` (auto, ray://host:port, host:port), or start a local
    instance; True when this call started the connection (disconnect_ray() ends it). Ray installs
    its own SIGTERM handler (an abrupt exit): the process's own stop handlers are put back."""
    import logging

    import ray

    if ray.is_initialized():
        return False
    _check_reachable(address)
    handlers = {stop_signal: signal.getsignal(stop_signal) for stop_signal in STOP_SIGNALS}
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as error:
        where = address or "a new local instance"
        raise ShardkitError(f"cannot connect to the Ray cluster at {where}: {error}") from None
    finally:
        for stop_signal, handler in handlers.items():
            if handler is not None:
                signal.signal(stop_signal, handler)
    return True


def _check_reachable(address: str | None, timeout: float = 5.0) -> None:
    """A cluster address (host:port or ray://host:port) must answer: ray.init waits for minutes on
    one where nothing listens. 'auto' and None are Ray's to resolve (they fail fast)."""
    import socket

    if address is None or address == "auto" or address == "local":
        return
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ShardkitError(f"cannot connect to the Ray cluster at {address}: not host:port or ray://host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as error:
        raise ShardkitError(f"cannot connect to the Ray cluster at {address}: {describe(error)}") from None


def disconnect_ray() -> None:
    import ray

    ray.shutdown()


def map_ray(
    function: Callable[..., Result],
    jobs: Iterable[Any],
    *,
    address: str | None = None,
    max_retries: int = 3,
    nodes: dict[int, str] | None = None,
    cancel: bool = True,
) -> Iterator[tuple[int, Result]]:
    """Yield (job index, result) as Ray tasks finish; each job is one task of `function`.

    Uses the Ray connection this process has (connect_ray), or makes one to `address` for the
    duration. Tasks are spread across nodes; a task whose worker or node dies is retried by Ray up
    to `max_retries` times. `nodes`, when given, receives the id of the node that ran each job.
    Stopped early, it cancels the tasks left, unless `cancel` is False: the caller is about to end
    the connection, which ends them (cancelling first races replies in flight: a Ray check-failure).
    """
    import ray
    from ray.exceptions import RayError, RayTaskError, WorkerCrashedError

    started_here = connect_ray(address)
    remote: Any = ray.remote(num_cpus=1, max_retries=max_retries, scheduling_strategy="SPREAD")(_on_ray_node)
    # Jobs are drawn as tasks finish (a plan still being walked feeds them): enough in flight to
    # keep every CPU of the cluster busy, and never the whole plan in the driver.
    cpus = ray.cluster_resources().get("CPU", 1)  # type: ignore[no-untyped-call]  # (ray has no hints for it)
    in_flight = max(4, 2 * int(cpus))
    numbered = enumerate(jobs)
    pending: dict[Any, int] = {}
    try:
        while True:
            while len(pending) < in_flight and (index_job := next(numbered, None)) is not None:
                pending[remote.remote(function, index_job[1])] = index_job[0]
            if not pending:
                break
            done, _ = ray.wait(list(pending), num_returns=1, timeout=0.25)
            for ref in done:
                index = pending.pop(ref)
                try:
                    node, result = ray.get(ref)
                except RayTaskError as error:
                    cause = error.cause
                    if isinstance(cause, ShardkitError):
                        raise cause from None
                    raise ShardkitError(f"Ray task for job {index} failed: {cause!r}") from None
                except WorkerCrashedError:
                    raise WorkerDiedError(f"Ray worker for job {index} died {max_retries + 1} times") from None
                except RayError as error:
                    raise ShardkitError(f"Ray task for job {index} failed: {error}") from None
                if nodes is not None:
                    nodes[index] = node
                yield index, result
    finally:
        if started_here:
            disconnect_ray()  # ends this job's tasks with it
        elif cancel:
            for ref in pending:
                ray.cancel(ref, force=True)
