"""Transformer building blocks: specs, attention, MLP, layers, block, position embeddings."""
