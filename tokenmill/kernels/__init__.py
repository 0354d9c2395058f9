"""Kernels: torch references (``reference``) and Triton kernels (``triton_ops``)."""
