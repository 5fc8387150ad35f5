"""Tensor and sequence parallelism: layers, autograd communication, cross entropy, RNG, checkpointing."""
