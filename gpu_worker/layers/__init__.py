"""The linear layers a model can run on (packed, our bf16 kernels, int8, GGUF quantized), and the choice among them."""
