"""Tensor parallelism on torch.distributed: the rank's group, collectives and weight sharding."""
