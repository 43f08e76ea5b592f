"""PackedLinear (csrc/linear.cpp) against F.linear: shapes with ragged edges, bias, strided rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.linear import PackedLinear, pack_linears

pytestmark = pytest.mark.usefixtures("native_isa")  # each test on every ISA's kernels

SHAPES = [(5, 7), (40, 64), (960, 576), (576, 1536), (33, 577)]  # (out, in): N, K not multiples of 32


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_float32_path_matches_f_linear(n, k, bias) -> None:
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    layer = PackedLinear(w, b)
    for m in (1, 7, 12, 13, 64):
        x = torch.randn(m, k, generator=gen)
        torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-4 * k**0.5, rtol=1e-5)


def test_rows_do_not_depend_on_the_batch() -> None:
    """A row gets bit-identical results alone and inside any batch."""
    gen = torch.Generator().manual_seed(0)
    layer = PackedLinear(torch.randn(96, 80, generator=gen), None)
    x = torch.randn(29, 80, generator=gen)
    full = layer(x)
    for m in (1, 5, 12, 17):
        assert torch.equal(layer(x[:m]), full[:m])
        assert torch.equal(layer(x[-m:]), full[-m:])


def test_pack_linears_replaces_every_linear_and_a_tied_lm_head() -> None:
    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(50, 16)
            self.proj = torch.nn.Linear(16, 16)
            self.lm_head = None

    model = Tiny()
    w, b, emb = model.proj.weight.clone(), model.proj.bias.clone(), model.embed_tokens.weight.clone()
    assert pack_linears(model) == 2
    x = torch.randn(3, 16)
    torch.testing.assert_close(model.proj(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.lm_head(x), x @ emb.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("m", [3, 40])  # a partial tile, several tiles
def test_strided_rows(m) -> None:
    """Rows with a stride (the gate half of a fused gate/up output) are read in place."""
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(48, 70, generator=gen)
    layer = PackedLinear(w, None)
    wide = torch.randn(m, 140, generator=gen)
    x = wide[:, :70]
    assert not x.is_contiguous()
    torch.testing.assert_close(layer(x), layer(x.contiguous()), atol=0, rtol=0)
