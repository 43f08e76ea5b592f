"""The mixture-of-experts block's native call (``csrc/moe.cpp``): its descriptor and the call.

``moe_desc`` checks what the C code cannot (sizes that fit together) and raises ValueError
where they do not; ``fused_moe`` returns None where the kernel cannot run (no library, not
float32 on the CPU) and the caller runs PyTorch.
"""

from __future__ import annotations

import ctypes

import torch

from pagedllm.kernels import abi
from pagedllm.kernels.args import ptr
from pagedllm.kernels.library import native_library
from pagedllm.kernels.linear import LINEAR_F32, LinearDesc

MoeDesc = abi.STRUCTS["MoeDesc"]  # the block's descriptor (pagedllm_abi.h documents each field)


class NativeMoE:
    """A ``MoeDesc`` and the descriptor arrays it points into (alive as long as this is).

    Args:
        router: a float32 packed layer [num_experts, hidden] (``kernels.linear.linear_desc``'s kind F32).
        gate_up: per expert its [2 intermediate, hidden] layer (gate rows first), any kind.
        down: per expert its [hidden, intermediate] layer.
        top_k: experts per token, 1..num_experts; renormalize: the kept weights sum to 1.

    The layers' tensors must outlive this object (the descriptors hold their addresses).

    Raises:
        ValueError: sizes that do not fit together, a router not float32, or a bad top_k.
    """

    def __init__(
        self, router: LinearDesc, gate_up: list[LinearDesc], down: list[LinearDesc], top_k: int, renormalize: bool
    ) -> None:
        num_experts, hidden = router.n, router.k
        intermediate = down[0].k if down else 0
        if router.kind != LINEAR_F32:
            raise ValueError(f"the router must be a float32 packed layer, got kind {router.kind}")
        if len(gate_up) != num_experts or len(down) != num_experts or not 1 <= top_k <= num_experts:
            raise ValueError(
                f"{num_experts} router rows, {len(gate_up)} gate/up and {len(down)} down layers, top_k {top_k}"
            )
        for e, (gu, d) in enumerate(zip(gate_up, down, strict=True)):
            if (gu.n, gu.k, d.n, d.k) != (2 * intermediate, hidden, hidden, intermediate):
                raise ValueError(
                    f"expert {e}: gate/up [{gu.n}, {gu.k}], down [{d.n}, {d.k}] for hidden {hidden}, "
                    f"intermediate {intermediate}"
                )
        self.gate_up = (LinearDesc * num_experts)(*gate_up)
        self.down = (LinearDesc * num_experts)(*down)
        self.desc = MoeDesc(
            num_experts=num_experts, top_k=top_k, renormalize=int(renormalize), hidden=hidden,
            intermediate=intermediate, router=router,
            gate_up=ctypes.cast(self.gate_up, ctypes.POINTER(LinearDesc)),
            down=ctypes.cast(self.down, ctypes.POINTER(LinearDesc)),
        )


def fused_moe(block: NativeMoE, x: torch.Tensor) -> torch.Tensor | None:
    """The block over x [T, hidden] float32 (rows at any stride) -> [T, hidden] float32: each
    token's top_k experts' SwiGLU outputs weighted by their router probabilities and summed;
    None where the kernel cannot run.

    Raises:
        ValueError: x is not [T, hidden].
    """
    lib = native_library()
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    hidden = block.desc.hidden
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"fused_moe: x must be [T, {hidden}], got {list(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], hidden)
    status = lib.fused_moe(ctypes.byref(block.desc), ptr(x), x.stride(0), x.shape[0], ptr(out))
    return out if status == 0 else None
