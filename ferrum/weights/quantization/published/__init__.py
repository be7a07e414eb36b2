"""Published quantized checkpoints (GPTQ, AWQ, FP8, compressed-tensors, GGUF), repacked at load into
the seam's storage (ferrum.weights.quantization.tensor) where that is exact."""
