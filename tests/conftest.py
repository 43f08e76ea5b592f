"""Shared test set-up."""

import os

# As pagedllm itself does on import, but before any test module imports torch: spinning
# OpenMP waiters stall for whole scheduler slices when the server processes these tests
# start share the two cores with the test process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
