"""fp8 training, asked of a live run: the what-if of its matmuls' tensors cast to fp8 (casts.py,
whatif.py), and the run converted to fp8 with torchao (conversion.py)."""
