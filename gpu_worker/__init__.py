"""The model worker process: the model, its KV tensors, sampling.

- `runtime/`: the process at run time: `Worker` and its descriptor loop, batch state,
  host staging, sampling and grammars, the KV pool, the tensor-parallel group, and the
  process's OpenMP, malloc and huge-page policies.
- `model/`: families, config and weight loading, and the decoder (its three paths).
- `layers/`: the linear layer kinds and the MoE experts' paths, and `choose_linear` and
  `choose_experts`, which pick them at load and say why.
- `kernels/`: the C++ CPU kernels (`csrc/`) and their build and load as torch ops.
- `sim/`: the simulated worker, step-time profiles (fit, sweep) and replay of recordings.
"""
