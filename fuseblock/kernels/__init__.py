"""Triton kernels. Import-safe without a GPU; launched only on CUDA or under TRITON_INTERPRET=1."""
