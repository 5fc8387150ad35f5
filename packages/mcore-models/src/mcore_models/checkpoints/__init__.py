"""Self-describing checkpoints: the files beside an mcore-train checkpoint's tensors, and loading a
checkpoint (mcore-train's or a Hugging Face directory) for inference."""
