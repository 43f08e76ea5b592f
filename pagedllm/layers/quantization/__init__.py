"""Weight-only int8 / int4 quantization of the linear layers (``--quantization``).

``config`` (the settings), ``weights`` (unpacked formats and quantizers), ``linear`` (layers
on PyTorch's packed CPU kernels), ``gguf`` (GGUF Q8_0 / Q4_0 / Q4_1 blocks kept as they
are), ``model`` (replacing a loaded model's layers). Import the submodules directly: this
package imports nothing, so ``pagedllm.config`` can use ``config`` without a cycle.
"""
