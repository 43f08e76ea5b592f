"""Layers with a PyTorch and a native-kernel implementation of one contract, chosen once."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.kernels import library


class CustomOp(nn.Module):
    """A layer whose ``forward`` is ``forward_cpu`` (the native kernels) or ``forward_native``
    (PyTorch), picked once when the layer is built: the kernels where this process runs a
    native library (``library.available()``) and ``covered`` says they take the layer's case
    (its sizes), else PyTorch. The two give the same results within float rounding.

    A case that depends on the tensors of a call (a dtype the model was cast to after it was
    built, the K/V cache's dtype) is ``forward_cpu``'s to check, explicitly, handing such a
    call to ``forward_native``.

    Args:
        covered: whether the kernels take this layer's build-time case.
    """

    def __init__(self, covered: bool = True) -> None:
        super().__init__()
        self.uses_native = covered and library.available()
        self._forward = self.forward_cpu if self.uses_native else self.forward_native

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """The layer in PyTorch."""
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        """The layer on the native CPU kernels."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"native={self.uses_native}"
