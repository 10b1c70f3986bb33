"""Quantized weight formats: decoding GGUF tensor encodings to torch tensors."""

from tianxia.quant.gguf_codecs import (
    SUPPORTED_TYPES,
    UnsupportedQuantTypeError,
    block_info,
    dequantize,
)

__all__ = ["SUPPORTED_TYPES", "UnsupportedQuantTypeError", "block_info", "dequantize"]
