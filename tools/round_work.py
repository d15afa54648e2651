"""What the round benchmarks run: the Qwen3.5-27B text model's shape (built with random weights), the lanes' work at
POSITION, a backend for each case (free drafts for the target's own verify round; mtp; dflash2 with each head and weight
form), a random shortlist head and 4-bit packing where a case asks for them, and the bytes a round must move (its
floor).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from ignis.backends.base import BackendContext, Choice, Committed, Proposal, SpecBackend
from ignis.backends.dflash2.backend import DFlash2
from ignis.backends.dflash2.config import DrafterConfig, drafter_config_json
from ignis.backends.dflash2.weights import SHORTLIST, random_drafter, spread_layer_ids
from ignis.backends.mtp import load as load_mtp
from ignis.config import load_config
from ignis.engine.request import Request
from ignis.engine.sampling import make_generator
from ignis.engine.scheduler import Decode
from ignis.model.model import HybridModel
from ignis.params import SamplingParams
from ignis.quant.linear import QuantLinear, to_mma, uses_mma
from ignis.train.shortlist import build as build_shortlist

# Qwen3.5-27B text model (research/qwen35.md): 64 layers, 48 Gated DeltaNet + 16 gated attention.
QWEN35_27B: dict[str, Any] = {
    "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6, "eos_token_id": [248044],
}
POSITION = 512  # every lane's anchor position while timing (a 512-token context)


class FreeDrafts:
    """A graph-safe backend whose drafts cost nothing (the anchor repeated): the target's own verify round."""

    name = "verify"
    tap_layers: tuple[int, ...] = ()
    graph_safe = True

    def __init__(self, k: int) -> None:
        self.draft_tokens = k

    def nbytes(self) -> int:
        return 0

    def reset(self, lane: int) -> None:
        pass

    def observe(self, obs: list[Any]) -> None:
        pass

    def propose(self, inp: Any) -> Proposal:
        raise NotImplementedError

    def propose_lanes(self, lanes: torch.Tensor, anchors: torch.Tensor, positions: torch.Tensor, k: int,
                      choice: Choice, span: int) -> Proposal:
        return Proposal(anchors[:, None].expand(-1, k), None)

    def observe_lanes(self, rows: Committed, span: int) -> None:
        pass


@dataclass
class Case:
    name: str
    backend: str  # off | verify | mtp | dflash2
    k: int
    lanes: int = 1


# every kind of round, once: each runs at every lane count --lanes asks for
CASES = [Case("decode", "off", 0), Case("verify", "verify", 7), Case("mtp", "mtp", 7),
         Case("mtp-h4", "mtp-head4", 7), Case("dflash2", "dflash2", 7),
         Case("dflash2-sl", "dflash2-shortlist", 7), Case("dflash2-sl-fp8", "dflash2-shortlist-fp8", 7),
         Case("dflash2-sl-int4", "dflash2-shortlist-int4", 7), Case("dflash2-h4", "dflash2-head4", 7),
         Case("dflash2-h4-int4", "dflash2-head4-int4", 7), Case("dflash2-h4-fp8", "dflash2-head4-fp8", 7),
         Case("dflash2-auto", "dflash2-auto", 7), Case("dflash2-g4", "dflash2-g4", 7),
         Case("dflash2-h4-g4", "dflash2-head4-g4", 7), Case("dflash2-first", "dflash2-first", 7)]
# a drafting case's suffix -> its spec.draft_weights
WEIGHT_SUFFIXES = {"-fp8": "fp8", "-int4": "int4", "-g4": "int4-greedy"}
# the random 27B drafter's shortlist head (spec.draft_head = "shortlist"): as many tokens as docs/drafter-training.md's
# 27B command keeps (--shortlist 32768); the built-in drafter has its own (4,096)
SHORTLIST_TOKENS = 32768


def pack_int4(model: HybridModel) -> None:
    """The model as `ignis quantize --head` and the loader would hold it: every projection and the output head in
    4 bits over groups of 128, in the mma kernel's order where it runs, fused again."""
    from tools.bench_quant import fuse_and_own, to_int4

    to_int4(model, 128, head=True)
    if uses_mma(model.embed_tokens.weight.device, model.embed_tokens.weight.dtype):
        to_mma(model, model.embed_tokens.weight.dtype)
    fuse_and_own(model)


def floor_bytes(model: HybridModel, lanes: int, cols: int, position: int = POSITION) -> int:
    """Bytes a round must move: the target's weights once (the embedding only where it is the output head too),
    and per lane the recurrent state read and written plus the keys and values of its context (`position` slots and
    the round's columns) read."""
    c = model.config
    skip = {"embed_tokens.weight"} if model.lm_head is not None else set()
    weights = sum(p.nbytes for n, p in model.named_parameters() if not n.startswith("mtp.") and n not in skip)
    weights += sum(t.nbytes for n, m in model.named_modules() if isinstance(m, QuantLinear) and not n.startswith("mtp.")
                   for t in m.buffers(recurse=False))  # a 4-bit target's codes, scales and zero points
    elt = model.embed_tokens.weight.element_size()
    gdn = sum(1 for t in c.layer_types if t == "linear_attention")
    attn = len(c.layer_types) - gdn
    state = gdn * (2 * 4 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim)
    kv = attn * 2 * c.num_key_value_heads * c.head_dim * elt * (position + cols)
    return weights + lanes * (state + kv)


def build_backend(kind: str, k: int, model: HybridModel, path: Path, lanes: int, context: int,
                  device: torch.device, dtype: torch.dtype) -> SpecBackend:
    if kind in ("off", "verify"):
        return FreeDrafts(k)
    head, weights, first = "full", "model", ""
    if kind.startswith("mtp"):  # mtp-head4: its drafts through the target's head in 4 bits, spec.draft_head = "int4"
        kind, head = "mtp", "int4" if kind == "mtp-head4" else "full"
    elif kind in ("dflash2-auto", "dflash2-first"):  # what the engine's defaults resolve to for this model and device
        # dflash2-first: the random drafter in the first-draft form (the target's MTP layer drafts slot 1, ADR 0017)
        first = "mtp" if kind == "dflash2-first" else ""
        kind, head, weights = "dflash2", "auto", "auto"
    elif kind.startswith("dflash2-"):
        weights = next((w for s, w in WEIGHT_SUFFIXES.items() if kind.endswith(s)), "model")
        if kind.startswith(("dflash2-shortlist", "dflash2-head4")):
            head = "shortlist" if kind.startswith("dflash2-shortlist") else "int4"
        kind = "dflash2"
    overrides = {"model.path": str(path), "spec.backend": kind, "spec.draft_tokens": k, "spec.draft_head": head,
                 "spec.draft_weights": weights, "log.level": "warning"}
    ctx = BackendContext(model, load_config(overrides=overrides), path, lanes, context, device, dtype)
    if kind == "mtp":
        return load_mtp(ctx)
    drafter = None
    if not (path / "drafter" / "config.json").is_file():
        if head == "shortlist":
            random_shortlist(model, path / "drafter", SHORTLIST_TOKENS)
        cfg = DrafterConfig.from_dict(drafter_config_json(
            model.config, num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128, block_size=8,
            mask_token_id=model.config.vocab_size - 1, target_layer_ids=spread_layer_ids(model.config.num_hidden_layers, 5),
            selector_rank=256, selector_top_k=16, first_draft=first), model.config)
        drafter = random_drafter(cfg, seed=1, device=device, dtype=dtype)
    return DFlash2(ctx, drafter)


def random_shortlist(model: HybridModel, drafter_dir: Path, tokens: int) -> None:
    """A shortlist head for a drafter that has none on disk: the target's output rows of `tokens` random ids
    (ignis.backends.dflash2.shortlist's format), so a round can be timed with spec.draft_head = "shortlist"."""
    if (drafter_dir / SHORTLIST).is_file():
        return
    head = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
    counts = torch.zeros(head.shape[0])  # one count each for `tokens` random ids: the shortlist keeps them in id order
    counts[torch.randperm(head.shape[0], generator=torch.Generator().manual_seed(0))[:tokens]] = 1.0
    build_shortlist(head, drafter_dir / SHORTLIST, counts, tokens)


# the sampled rounds' requests (--sampled): the acceptance tool's sampled suite's parameters
SAMPLED = SamplingParams(max_tokens=4096, temperature=1.0, top_p=0.95, top_k=20)


def decodes(lanes: int, k: int, position: int = POSITION, sampled: bool = False,
            top_k: int = SAMPLED.top_k) -> list[Decode]:
    """`lanes` requests at `position`, each drafting `k`: greedy, or sampled as `SAMPLED` with its top-k `top_k` (the
    target's draws, rejection sampling and drafts drawn from the drafter's distribution)."""
    out = []
    params = msgspec.structs.replace(SAMPLED, top_k=top_k) if sampled else SamplingParams(max_tokens=4096,
                                                                                          temperature=0.0)
    for lane in range(lanes):
        r = Request(id=str(lane), prompt=[1] * position, params=params,
                    stop_ids=frozenset(), generator=make_generator(lane), seed=lane)
        r.tokens.append(2)
        r.lane, r.computed = lane, position
        out.append(Decode(r, k))
    return out
