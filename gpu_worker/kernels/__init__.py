"""The kernels: the C++ CPU kernels (csrc/, built and loaded as torch ops by cpu_kernels.py) and the
Triton kernels of the CUDA path (triton/, `--attention-backend triton`)."""
