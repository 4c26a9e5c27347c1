"""Quantized weights: GGUF block formats read directly by compiled CPU kernels."""
