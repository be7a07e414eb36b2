"""Weight quantization: the schemes (what a layer is quantized to), the stored layout of each
(`QuantizedTensor`: packed values, scales, zeros) and the arithmetic between full precision and it.

    scheme.py    QuantScheme (one layer's method and group size) and QuantizationConfig (the
                 served model's: the method, its options and the layers it skips)
    tensor.py    QuantizedTensor: the typed bundle one weight becomes; its parts and their shapes
    arith.py     quantize / dequantize, per method
"""
