"""The model: families, config, weight loading, and the decoder (modules, flat loop, compiled layer)."""
