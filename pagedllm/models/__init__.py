"""Model definitions (``llama``, ``registry``) and loading (``loader``: GGUF files, HF
safetensors checkpoints, installed model packages). Import the submodules directly: this
package imports nothing, so resolving a model name does not pay for torch or transformers.
"""
