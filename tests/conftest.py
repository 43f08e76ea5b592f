"""Shared test set-up: the ISA fixture of the kernel tests, the sampler tests' two draw
implementations, the session's shared server, and the server, client and http fixtures of the
test_server_* modules on it."""

import os

# As pagedllm itself does on import, but before any test module imports torch: spinning
# OpenMP waiters stall for whole scheduler slices when the server processes these tests
# start share the two cores with the test process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402

from tests.native_isa import ISAS, on_isa  # noqa: E402  (imports pagedllm, hence torch: after the line above)
from tests.server_util import (  # noqa: E402
    API_KEY,
    SHARED_SERVER_ENV,
    SHARED_SERVER_FLAGS,
    Server,
    start_server,
    stop_server,
)


@pytest.fixture(params=ISAS)
def native_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each ISA this CPU executes in turn: the test's native calls run on that ISA's library
    (skipped, quoting the compiler, where it does not build)."""
    with on_isa(request.param):
        yield request.param


@pytest.fixture(params=["native", "pytorch"])
def draw_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The random draw, logprobs and penalties on the native kernels, then in PyTorch: every test of
    the test_sampler_* modules runs on both (their ``pytestmark = pytest.mark.usefixtures("draw_impl")``)."""
    import torch

    from pagedllm.kernels import library
    from pagedllm.layers import sampler as sampler_module
    from pagedllm.layers.logprobs import RowLogprobs
    from pagedllm.layers.sampler import RowDraw

    if request.param == "native" and not library.available():
        pytest.skip("no native kernels here")
    if request.param == "pytorch":
        monkeypatch.setattr(RowDraw, "forward_cpu", RowDraw.forward_native)
        monkeypatch.setattr(RowLogprobs, "forward_cpu", RowLogprobs.forward_native)
        monkeypatch.setattr(sampler_module.library, "available", lambda: False)  # penalties in PyTorch
    torch.manual_seed(0)
    return request.param


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's tokenizer saved as a folder: the tokenizer of the tiny random-weight
    checkpoints the model tests write beside it."""
    from pagedllm.models.loader import load_tokenizer, resolve_model

    path = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(resolve_model("smollm2")).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server of the default model for every module whose tests fit its flags
    (``server_util.SHARED_SERVER_FLAGS``), started on first use and stopped at the session's end, as
    vLLM's ``RemoteOpenAIServer``. Tests that stop, kill or reconfigure a server start their own;
    tests on this one leave it serving and idle."""
    s = start_server(tmp_path_factory.mktemp("shared-server"), *SHARED_SERVER_FLAGS, env=SHARED_SERVER_ENV)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def server(shared_server: Server) -> Server:
    """The session's shared server (conftest.py): float32, API key, a 64 KiB body limit."""
    return shared_server


def _timeout_s(request: pytest.FixtureRequest) -> float:
    """A module's ``CLIENT_TIMEOUT_S`` (seconds a request to the server may take), else 120."""
    return getattr(request.module, "CLIENT_TIMEOUT_S", 120)


@pytest.fixture(scope="module")
def client(server: Server, request: pytest.FixtureRequest) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=_timeout_s(request))


@pytest.fixture(scope="module")
def http(server: Server, request: pytest.FixtureRequest) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=_timeout_s(request)) as c:
        yield c
