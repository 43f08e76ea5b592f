"""Native CPU kernels: ISA detection (``isa``), per-ISA builds (``build``), the library this
process runs (``library``), its C interface (``abi``), and the typed wrappers that call into
it, one module per role: ``attention`` (paged attention, K/V write), ``elementwise`` (norm,
RoPE, activations, argmax), ``linear`` (packed GEMMs), ``kquant`` (GGUF blocks as stored),
``moe`` (a mixture-of-experts block) and ``decoder`` (a whole decode step); ``args`` holds
their shared argument checks."""
