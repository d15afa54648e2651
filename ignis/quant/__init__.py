"""Weight quantization: the 4-bit on-disk format (ignis.quant.format), the packed linear every 4-bit projection calls
(ignis.quant.linear; its GPU kernel is ignis.kernels.int4_gemv), the shard-by-shard converter behind `ignis quantize`
(ignis.quant.convert), and fp8 weights made at load time (ignis.quant.fp8). docs/quantization.md describes the layout;
the memory plan that counts packed and fp8 weights is ignis.plan."""
