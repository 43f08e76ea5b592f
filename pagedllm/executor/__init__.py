"""Executors: run each scheduled step on the model's tensor-parallel ranks."""
