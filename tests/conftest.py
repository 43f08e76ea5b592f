"""Shared test set-up."""

import os

# As pagedllm itself does on import, but before any test module imports torch: spinning
# OpenMP waiters stall for whole scheduler slices when the server processes these tests
# start share the two cores with the test process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
from native_isa import ISAS, on_isa  # noqa: E402  (imports pagedllm, hence torch: after the line above)


@pytest.fixture(params=ISAS)
def native_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each ISA this CPU executes in turn: the test's native calls run on that ISA's library
    (skipped, quoting the compiler, where it does not build)."""
    with on_isa(request.param):
        yield request.param
