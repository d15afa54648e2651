"""Which Gated DeltaNet kernel trains the target: fla's chunked Triton kernel when its gradients agree with the
torch reference on this GPU, else transformers' torch reference.

Owns: that choice and the check behind it. Does not own: the GDN layer (transformers' Qwen3_5GatedDeltaNet) or
inference kernels (ignis.kernels).

fla 0.6 refuses to run its gated backward on Hopper with Triton 3.4-3.7.0: Triton miscompiles `chunk_bwd_dqkwg`
for 64-wide key blocks (fla issue 640; 32- and 128-wide blocks are exact). The target's keys are 128 wide, so the
refusal is lifted here and the kernel is checked against the reference on the run's own shapes instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5

MAX_RELATIVE_ERROR = 0.05  # bf16 round-off is ~1e-2; the miscompile is off by O(1)


def _grads(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], inputs: list[torch.Tensor],
           upstream: torch.Tensor) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    q, k, v, g, beta = leaves
    out, _ = fn(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=True)
    out.backward(upstream)
    return [out.detach().float()] + [x.grad.float() for x in leaves]  # type: ignore[union-attr]


def reference_rule() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """transformers' own torch implementation of the chunked gated delta rule, from under its kernel decorators: a
    function wrapped by functools.wraps, or (transformers 5.25 on, with the `kernels` package) a module whose forward
    calls that wrapper."""
    rule = modeling_qwen3_5.torch_chunk_gated_delta_rule
    if isinstance(rule, torch.nn.Module):
        cells = type(rule).forward.__closure__ or ()
        rule = next(c.cell_contents for c in cells if inspect.isfunction(c.cell_contents))
    return inspect.unwrap(rule)  # type: ignore[no-any-return]


def choose(device: torch.device, heads: int, key_dim: int, value_dim: int, log: Callable[[str], None]) -> str:
    """'fla' or 'torch'; with 'torch', transformers' GDN layers are pointed at the reference for this process."""
    reference = reference_rule()
    if device.type != "cuda":
        return "torch"
    try:
        from fla.ops.common import chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        chunk_o.TRITON_ABOVE_3_7_1 = True
        gen = torch.Generator(device=device).manual_seed(0)
        shape = (2, 256, heads)
        q = torch.randn(*shape, key_dim, device=device, generator=gen).bfloat16()
        k = torch.randn(*shape, key_dim, device=device, generator=gen).bfloat16()
        v = torch.randn(*shape, value_dim, device=device, generator=gen).bfloat16()
        g = F.logsigmoid(torch.randn(*shape, device=device, generator=gen))
        beta = torch.rand(*shape, device=device, generator=gen).bfloat16()
        upstream = torch.randn(*shape, value_dim, device=device, generator=gen).bfloat16()
        got = _grads(chunk_gated_delta_rule, [q, k, v, g, beta], upstream)
        want = _grads(reference, [q, k, v, g, beta], upstream)
        errors = [float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(got, want)]
    except Exception as exc:  # any failure to build or run the kernel means the reference trains instead
        errors, got = [float("inf")], []
        log(f"fla gated delta rule unusable: {exc!r}")
    names = ["out", "dq", "dk", "dv", "dg", "dbeta"]
    log("fla vs torch relative errors: " + ", ".join(f"{n} {e:.2e}" for n, e in zip(names, errors)))
    if max(errors) <= MAX_RELATIVE_ERROR:
        return "fla"
    modeling_qwen3_5.torch_chunk_gated_delta_rule = reference
    return "torch"
