"""ignis.kernels: GPU kernels of our own, each beside its torch reference and a provenance note in docs/adr/.

Owns: the exact top-k over the drafter's vocabulary (`ignis.kernels.topk`) and the 4-bit GEMV/GEMM for decode and
verify rows (`ignis.kernels.int4_gemv`). Does not own: library kernels used as they are (torch SDPA, fla's Gated
DeltaNet kernels), nor when the engine calls a kernel.

Importing this package, `ignis.kernels.topk` or `ignis.kernels.int4_gemv` imports neither numba nor CUDA and
compiles nothing: a numba-cuda kernel is built on the first call with a CUDA tensor, so CPU-only machines never need
a driver.
"""
