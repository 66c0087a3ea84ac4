"""The one GPU boundary: what nvidia-smi reports."""
