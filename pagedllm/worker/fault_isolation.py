"""Fault isolation for the sampling stages of a step: a request whose sampling, verification or
logprobs raise fails alone, with the reason, and the other requests of the batch keep theirs.

A batched stage that raises is rerun one request at a time to find the culprit. Running out of
memory is no one request's fault (``FATAL``): it propagates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from pagedllm.core.request import Request
from pagedllm.errors import InvalidParamError
from pagedllm.outputs import RequestError

logger = logging.getLogger("pagedllm")
R = TypeVar("R")

# Faults of the process, not of any request: isolating them per request would only hide them.
FATAL = (MemoryError, torch.OutOfMemoryError)


def run_isolated(
    run: Callable[[list[int]], list[R]],
    requests: list[tuple[int, Request]],
    errors: dict[int, RequestError],
    stage: str,
) -> list[R | None]:
    """``run`` over all of ``requests`` at once; if that raises, over each alone.

    Args:
        run: maps positions in ``requests`` to one result per position; raises on failure.
        requests: (output index, request) per position.
        errors: filled with the output index -> message of each request that fails alone.
        stage: what ``run`` does, for messages.

    Returns:
        One result per position, None where the request failed.

    Raises:
        MemoryError, torch.OutOfMemoryError: from ``run``, at once (``FATAL``).
    """
    # A batch that raised may have drawn from seeded generators: rewind them so a retried
    # request samples what it would have sampled in a healthy batch.
    states = [(r.generator, r.generator.get_state()) for _, r in requests if r.generator is not None]
    try:
        return list(run(list(range(len(requests)))))
    except FATAL:
        raise
    except Exception:
        logger.warning("batched %s of %d requests failed; retrying one by one", stage, len(requests))
    for generator, state in states:
        generator.set_state(state)
    results: list[R | None] = []
    for j, (i, request) in enumerate(requests):
        try:
            results.extend(run([j]))
        except FATAL:
            raise
        except Exception as e:
            errors[i] = request_error(request, stage, e)
            results.append(None)
    return results


def request_error(request: Request, stage: str, error: Exception) -> RequestError:
    """What ``request`` reports after failing alone in ``stage`` with ``error``, logged: the
    message of an ``InvalidParamError`` (the request's own input) with its field, else the
    error's type and message (logged with its traceback)."""
    if isinstance(error, InvalidParamError):  # the request's own input: no traceback
        logger.warning("request %s failed in %s: %s", request.request_id, stage, error)
        return RequestError.of(error)
    logger.error("request %s failed in %s", request.request_id, stage, exc_info=error)
    return RequestError(f"{stage} failed: {type(error).__name__}: {error}")
