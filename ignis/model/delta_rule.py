"""The gated delta rule and the short causal conv in front of it: the arithmetic of a Gated DeltaNet layer.

Owns: the per-token recurrent step, the chunked form (one 64-row chunk at a time), the depthwise short conv as an
explicit sum over its taps, and the optional fla kernel for prefill on CUDA (one sequence a call, or several packed
into one call: `fla_varlen`). Does not own: projections, gates and
where the state lives (ignis.model.gdn, ignis.model.cache).

Per value head, with state S [dk, dv] (fp32 always):
    S <- exp(g_t) * S;   u_t = beta_t * (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t
q and k arrive l2-normalised, q scaled by dk^-1/2, and already repeated to the value heads (head j uses key j // r).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ignis.logging import get_logger
from ignis.model.ops import l2norm

CHUNK = 64
log = get_logger("ignis.model.delta_rule")


def short_conv(window: torch.Tensor, raw: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv, before SiLU. window [n, Kc-1, C], raw [n, L, C], weight [C, Kc] -> [n, L, C] float32.

    An explicit sum over the taps in a fixed order, so column t's bits depend only on its own Kc inputs: the same
    for a decode, a verify and a prefill."""
    kc = weight.shape[1]
    length = raw.shape[1]
    xs = torch.cat([window, raw], dim=1).float()
    w = weight.float()
    acc = xs[:, 0:length] * w[:, 0]
    for j in range(1, kc):
        acc = acc + xs[:, j : j + length] * w[:, j]
    return acc


def recurrent_step(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for n lanes. state [n, Hv, dk, dv] f32; q, k [n, Hv, dk] f32; v [n, Hv, dv] f32; g, beta [n, Hv] f32.

    Returns (new state [n, Hv, dk, dv], output [n, Hv, dv]); the output reads the updated state."""
    state = state * torch.exp(g)[..., None, None]
    memory = (k[..., None, :] @ state)[..., 0, :]  # [n, Hv, dv]: what the state predicts for k
    delta = (v - memory) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    out = (q[..., None, :] @ state)[..., 0, :]
    return state, out


def chunk_step(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of exactly CHUNK rows for one lane, head-major. state [Hv, dk, dv] f32; q, k [Hv, C, dk] f32;
    v [Hv, C, dv] f32; g, beta [Hv, C] f32 (padding rows: g = 0, beta = 0). Returns (state', output [Hv, C, dv]).

    With G the in-chunk cumulative log-decay and D_ij = exp(G_i - G_j) for j <= i (else 0), the chunk's C delta-rule
    updates are one unit-lower-triangular solve A = I + strict_lower((diag(beta) K K^T) * D):
        U = A^-1 diag(beta) V,   W = A^-1 diag(beta exp G) K,   Vn = U - W S
        O = diag(exp G) Q S + ((Q K^T) * D) Vn,   S' = exp(G_last) S + (diag(exp(G_last - G)) K)^T Vn
    """
    c = q.shape[1]
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    cum = g.cumsum(-1)  # [Hv, C]
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # [Hv, C, C]
    kb = k * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * decay
    # unitriangular: the solve reads only the strict lower part and takes the diagonal as 1.
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    vn = u - w @ state
    out = (q * cum.exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ vn
    last = cum[:, -1:]  # [Hv, 1]
    state = state * last.exp()[..., None] + (k * (last - cum).exp()[..., None]).transpose(-1, -2) @ vn
    return state, out


def chunked(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill segment of one lane, chunk by chunk. state [Hv, dk, dv] f32; q, k [L, Hv, dk] f32; v [L, Hv, dv] f32;
    g, beta [L, Hv] f32 -> (state', output [L, Hv, dv] f32). Each chunk is padded to exactly CHUNK rows, so its result
    depends only on its rows and the incoming state (prefill segments start at multiples of CHUNK)."""
    length = q.shape[0]
    out = q.new_empty(length, v.shape[1], v.shape[2])
    for c0 in range(0, length, CHUNK):
        n = min(CHUNK, length - c0)
        parts = [t[c0 : c0 + n] for t in (q, k, v, g, beta)]
        if n < CHUNK:
            parts = [torch.cat([t, t.new_zeros(CHUNK - n, *t.shape[1:])]) for t in parts]
        qc, kc, vc = (t.transpose(0, 1) for t in parts[:3])
        gc, bc = (t.transpose(0, 1) for t in parts[3:])
        state, o = chunk_step(state, qc, kc, vc, gc, bc)
        out[c0 : c0 + n] = o.transpose(0, 1)[:n]
    return state, out


@functools.cache
def fla_chunk(
    hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, device: torch.device
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """fla's chunk_gated_delta_rule for this layer shape, if fla is installed and agrees with the torch chunked form
    here; else None (use torch). Imported and checked on first use only, once per shape.

    fla's entry points have been seen to return NaN or miscompile for some shapes and Triton versions, so each shape is
    checked on random data against `chunked` before the kernel is trusted with a prefill."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - any failure to import (missing, no triton, no GPU) means "use torch"
        if device.type == "cuda":
            _no_fla(f"{type(e).__name__}: {e}")
        return None
    gen = torch.Generator(device="cpu").manual_seed(0)
    length, r = 150, hv // hk

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    q, k, v = rnd(length, hk, dk), rnd(length, hk, dk), rnd(length, hv, dv)
    g = -torch.rand(length, hv, generator=gen).to(device)
    beta = torch.rand(length, hv, generator=gen).to(device)
    state = rnd(hv, dk, dv) * 0.1
    try:
        o, s = chunk_gated_delta_rule(
            q[None].to(dtype), k[None].to(dtype), v[None].to(dtype), g=g[None], beta=beta[None].to(dtype),
            scale=dk**-0.5, initial_state=state[None].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
    except Exception:  # noqa: BLE001 - a kernel that cannot run this shape is as good as absent
        return None
    qn = l2norm(q).repeat_interleave(r, dim=1) * dk**-0.5
    kn = l2norm(k).repeat_interleave(r, dim=1)
    ref_s, ref_o = chunked(state, qn, kn, v, g, beta)
    tolerance = 1e-3 if dtype == torch.float32 else 2e-2
    if not _error(o[0], s[0], ref_o, ref_s) < tolerance:  # NaN fails too
        return None
    # Several sequences in one call (cu_seqlens), each from its own state: the split at 100 is not a chunk boundary.
    cut = 100
    states = torch.stack([state, rnd(hv, dk, dv) * 0.1])
    try:
        o, s = chunk_gated_delta_rule(
            q[None].to(dtype), k[None].to(dtype), v[None].to(dtype), g=g[None], beta=beta[None].to(dtype),
            scale=dk**-0.5, initial_state=states.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=torch.tensor([0, cut, length], dtype=torch.long, device=device),
        )
        errors = []
        for i, (a, b) in enumerate(((0, cut), (cut, length))):
            ref_s, ref_o = chunked(states[i], qn[a:b], kn[a:b], v[a:b], g[a:b], beta[a:b])
            errors.append(_error(o[0, a:b], s[i], ref_o, ref_s))
        _VARLEN[(hk, hv, dk, dv, dtype, device)] = max(errors) < tolerance
    except Exception:  # noqa: BLE001 - no packed form: one call a sequence still works
        _VARLEN[(hk, hv, dk, dv, dtype, device)] = False
    return chunk_gated_delta_rule  # type: ignore[no-any-return]


_VARLEN: dict[tuple[object, ...], bool] = {}  # shape -> whether fla's packed form passed fla_chunk's check


@functools.cache
def _no_fla(why: str) -> None:
    """Say once a process (once for each reason fla did not import) that CUDA prefills run the torch chunked form,
    many times slower on long prompts: train-drafter's taps took 421 s instead of 27 s on an H200 without fla
    (docs/drafter-training.md)."""
    log.warning("ignis.model.fla_missing", why=why,
                consequence="prefills on CUDA use the torch chunked form, many times slower on long prompts",
                fix="pip install 'ignis[gpu]' (fla-core)")


def fla_varlen(
    hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, device: torch.device
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """fla's kernel when it also takes several sequences in one call (`cu_seqlens`, one initial state each) and agreed
    with `chunked` on each in `fla_chunk`'s check, which runs (once per shape) if it has not yet; else None."""
    kernel = fla_chunk(hk, hv, dk, dv, dtype, device)
    return kernel if kernel is not None and _VARLEN.get((hk, hv, dk, dv, dtype, device), False) else None


def _error(o: torch.Tensor, s: torch.Tensor, ref_o: torch.Tensor, ref_s: torch.Tensor) -> float:
    """The larger relative error of an output and a final state against the reference's."""
    return max(float((o.float() - ref_o).norm() / ref_o.norm()), float((s.float() - ref_s).norm() / ref_s.norm()))
