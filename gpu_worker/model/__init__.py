"""The model: what a checkpoint says (families, config, weights) and the decoder that runs it.

- `families.py`, `model_config.py`, `rope_spec.py`: what each family switches on, and the
  per-checkpoint values, parsed from config.json or a GGUF header (`gguf_header.py`).
- `weights.py`, `gguf_weights.py`: the checkpoint's tensors under Hugging Face names;
  `weight_loading.py`: each of them into this rank's slice of the modules;
  `model_check.py`: the launcher's check that a checkpoint fits its config.
- `attention.py`, `rope.py`: paged attention over the KV pool, rotary tables.

One decoder layer, three ways to run it, each in one file:
- `decoder_layer.py` (the layer: norms, attention, MLP) and `decoder.py` (the model:
  `LlamaForCausalLM`, its forward and the kernels swapped in): every prefill, mixed and
  verify step, and the reference the other two must match.
- `flat_decode.py`: plain decode steps on CPU, eager, as one flat loop of op calls.
- `compiled_decode.py`: plain decode steps through one torch.compile'd layer (`--compile`).
"""
