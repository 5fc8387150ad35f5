"""Distributed checkpointing on ``torch.distributed.checkpoint``: reshardable state dicts, safe saves."""
