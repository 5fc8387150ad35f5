"""Data parallelism: contiguous bucketed gradient buffers and the DDP wrapper that reduces them."""
