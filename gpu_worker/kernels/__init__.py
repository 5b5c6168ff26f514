"""The C++ CPU kernels: their sources (csrc/) and their build and load as torch ops (cpu_kernels.py)."""
