"""Quantized weights: the formats cadence serves (int8 per output channel, int4 per
group), how they are made from float weights or read from GPTQ, AWQ and GGUF files, and
the products that multiply through them."""
