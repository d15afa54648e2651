"""4-bit weight-only quantization: the on-disk format (ignis.quant.format), the packed linear every model projection
calls (ignis.quant.linear), the shard-by-shard converter behind `ignis quantize` (ignis.quant.convert) and the memory
plan of a model directory under a profile (ignis.quant.plan). docs/quantization.md describes the layout."""
