"""ignis.kernels: GPU kernels of our own, each beside its torch reference and a provenance note in docs/adr/.

Owns: the exact top-k over the drafter's vocabulary (`topk`, ADR 0001); the Gated DeltaNet recurrence, its replay and
the conv window's commit (`gdn`, ADR 0004; a verify's in chunk form, `gdn_chunk`, and the replay in CUDA C++,
`replay_cuda`, ADR 0016); the decode round's fused layer kernels (`fused`: residual add + RMSNorm,
the GDN conv and gated norm, SwiGLU, q/k norms + RoPE + K/V write, the drafter's grouped conv); split-context paged
attention for decode and verify rounds (`attention`: a Triton kernel on tensor cores, `attention_triton`, ADR 0009,
or the numba one, ADR 0006); the 4-bit GEMV/GEMM for decode and verify rows (`int4_mma`, CUDA C++ on tensor cores
over codes repacked into their register order, compiled at run time by `nvrtc`; or, over the format's codes,
`int4_triton` on tensor cores or `int4_gemv`, ADR 0005); the dflash2 selector's work after the proposal head (`topk_cuda`,
a warp-sorted top-k of few wide rows in CUDA C++, and `selector_triton`, the 4-bit head's rescoring and the greedy
walk, ADR 0010).
Does not own: library kernels used as they are (torch SDPA, cuBLAS, fla's Gated DeltaNet prefill), nor when the
engine calls a kernel.

Importing this package or any of its launch modules imports neither numba, triton nor CUDA and compiles nothing: a
kernel is built on the first call with a CUDA tensor, so CPU-only machines never need a driver.
"""
