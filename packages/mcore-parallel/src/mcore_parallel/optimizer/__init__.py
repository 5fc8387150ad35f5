"""Optimizers: the distributed (ZeRO-1) optimizer with float32 main parameters, global-norm clipping."""
