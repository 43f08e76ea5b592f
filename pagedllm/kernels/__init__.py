"""Native CPU kernels: ISA detection (``isa``), per-ISA builds (``build``), the library this
process runs (``library``), and ``ops``, the only module that calls into it."""
