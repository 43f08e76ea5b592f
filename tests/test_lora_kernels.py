"""The LoRA compute path against references: ``lora_sgmv`` (the native kernel of one step's
adapter runs) against (x A.T) B.T in float64, a run alone or cut into pieces giving the same
bits; a fused ``LoRALinear`` through the native kernel and through its PyTorch matmuls; and the
dtype A and B are kept in (``--lora-dtype``). Adapters served end to end:
``test_lora_end_to_end*.py``."""

from __future__ import annotations

import pytest
import torch



def _pack(parts: list[tuple[torch.Tensor, torch.Tensor] | None], dtype: torch.dtype):
    """lora_sgmv's A.T [K, R] and B.T blocks [r, width] of one adapter's parts ((A.T [K, r],
    B.T [r, width]) or None) in panels, in ``dtype``, and its ranks [MAX_PARTS]."""
    from pagedllm.kernels.lora import MAX_PARTS, to_panels

    used = [p for p in parts if p is not None]
    a = to_panels(torch.cat([p[0] for p in used], 1).to(dtype))
    blocks = [to_panels(p[1].to(dtype)) for p in used]
    ranks = [0 if p is None else p[0].shape[1] for p in parts]
    return a, torch.cat(blocks), ranks + [0] * (MAX_PARTS - len(ranks))


@pytest.mark.usefixtures("native_isa")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("runs", [[(0, 1, 0), (1, 2, 1), (2, 3, 2)], [(0, 5, 1), (5, 40, 0), (40, 47, 2)]])
def test_lora_kernel_matches_torch(runs: list[tuple[int, int, int]], dtype: torch.dtype) -> None:
    """lora_sgmv against (x A.T) B.T per run and part (three parts of widths 45, 20, 13; ranks
    8/0/19 with a partial chunk, 0 everywhere (skipped), 3/5/0), A and B in float32 or
    bfloat16 (the reference from the same bfloat16 values: float32 rounding alone), x and y
    with strided rows; each run alone, and a run cut into pieces (other micro-tiles), give
    the same bits."""
    from pagedllm.kernels.lora import lora_sgmv

    torch.manual_seed(0)
    k, widths, t = 70, [45, 20, 13], runs[-1][1]
    shapes = [[8, 0, 19], [0, 0, 0], [3, 5, 0]]
    mats = [[None if r == 0 else (torch.randn(k, r).to(dtype), torch.randn(r, w).to(dtype))
             for r, w in zip(rs, widths, strict=True)] for rs in shapes]
    packed = [_pack(m, dtype) if any(m) else (torch.zeros(1), torch.zeros(1), [0, 0, 0]) for m in mats]
    x = torch.randn(t, 2 * k)[:, :k]
    y0 = torch.randn(t, sum(widths) + 3)[:, : sum(widths)]

    def run(rows: list[tuple[int, int, int]], y: torch.Tensor) -> None:
        lora_sgmv(x, y, torch.tensor(widths), torch.tensor([[a, b] for a, b, _ in rows]),
                  torch.tensor([packed[m][0].data_ptr() for *_, m in rows]),
                  torch.tensor([packed[m][1].data_ptr() for *_, m in rows]),
                  torch.tensor([packed[m][2] for *_, m in rows]), dtype=dtype)

    y = y0.clone()
    run(runs, y)
    ref = y0.clone()
    for a, b, m in runs:
        n0 = 0
        for part, w in zip(mats[m], widths, strict=True):
            if part is not None:
                ref[a:b, n0 : n0 + w] += (x[a:b].double() @ part[0].double() @ part[1].double()).float()
            n0 += w
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    for a, b, m in runs:  # one run alone, and cut after its first token: the same bits
        alone = y0.clone()
        run([(a, b, m)], alone)
        assert torch.equal(alone[a:b], y[a:b])
        cut = y0.clone()
        run([(a, a + 1, m), (a + 1, b, m)] if b > a + 1 else [(a, b, m)], cut)
        assert torch.equal(cut[a:b], y[a:b])
    with pytest.raises(ValueError, match="rank outside"):
        lora_sgmv(x, y, torch.tensor(widths), torch.tensor([[0, 1]]), torch.tensor([0]), torch.tensor([0]),
                  torch.tensor([[10**6, 0, 0]]))


@pytest.mark.usefixtures("native_isa")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_layer_kernel_and_pytorch_paths_agree(dtype: torch.dtype) -> None:
    """A fused LoRALinear (parts 45, 20, 13; one adapter on parts 0 and 2, one on part 1, a
    run of base tokens between) gives the same outputs through the native kernel and through
    its PyTorch matmuls, A and B kept in ``dtype``."""
    from pagedllm.layers.lora import LoRABatch, LoRALinear

    torch.manual_seed(1)
    widths, k = [45, 20, 13], 70
    batch = LoRABatch(dtype=dtype)
    layer = LoRALinear(torch.nn.Linear(k, sum(widths)), widths, batch)
    layer.set_adapter(1, {0: (torch.randn(8, k), torch.randn(45, 8)), 2: (torch.randn(19, k), torch.randn(13, 19))})
    layer.set_adapter(2, {1: (torch.randn(3, k), torch.randn(20, 3))})
    batch.set([(0, 5, 1), (7, 9, 2)])
    x = torch.randn(9, k)
    with torch.inference_mode():
        batch.native = True
        native = layer(x)
        batch.native = False
        reference = layer(x)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-4)
    assert not torch.equal(native, layer.base(x))

def test_lora_dtype_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """--lora-dtype auto: bfloat16 A and B under --dtype auto on the native kernels, else the
    model's dtype (None); an explicit choice wins; other names are refused."""
    from pagedllm.kernels import library
    from pagedllm.platforms.cpu import lora_dtype_setting

    monkeypatch.setattr(library, "active_isa", lambda: "avx512")
    assert lora_dtype_setting("auto") == torch.bfloat16
    assert lora_dtype_setting("float32") is None
    assert lora_dtype_setting("auto", "float32") == torch.float32
    assert lora_dtype_setting("float32", "bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="lora_dtype must be auto, float32 or bfloat16, got 'float16'"):
        lora_dtype_setting("auto", "float16")
    monkeypatch.setattr(library, "active_isa", lambda: None)
    assert lora_dtype_setting("auto") is None
