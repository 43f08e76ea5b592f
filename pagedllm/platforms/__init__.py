"""Per-platform policy (today the CPU): what ``auto`` settings mean on this machine."""
