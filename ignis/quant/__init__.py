"""4-bit weight-only quantization: the on-disk format (ignis.quant.format), the packed linear every model projection
calls (ignis.quant.linear) and the shard-by-shard converter behind `ignis quantize` (ignis.quant.convert).
docs/quantization.md describes the layout; the memory plan that counts packed weights is ignis.plan."""
