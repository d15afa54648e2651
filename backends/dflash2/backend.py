"""The `dflash2` backend: a DFlash-family block drafter that proposes every lane's drafts in one pass.

Owns: loading the drafter beside the target (config, weights, proposal head), the per-lane context it keeps, and
the propose / observe steps of the round. Does not own: the drafter's layer math (.model), the context's storage
(.context), the choice of drafts (.selector) or acceptance (ignis.engine.accept).

observe: the target's outputs at `target_layer_ids` for the committed rows become each drafter layer's context K/V,
once per token. propose: the block [anchor, MASK x k] of every lane, embedded with the target's embedding, at
positions anchor..anchor+k, runs through the drafter against that context; the rows after the anchor go through the
proposal head (the target's output head, the 4-bit shortlist head, or the target's head in 4 bits: .packed_head) and
the selector (DFlash2) or argmax (v1).
A drafter trained with slot 1 given (dflash_config.first_draft "mtp", docs/adr/0017) drafts behind the target's MTP
layer: the MTP layer (ignis.backends.mtp, observing the same rows) drafts slot 1, through the 4-bit head where the
block's head is that one; the block is [anchor, that draft, MASK x (k-1)], and its rows 2..k go through the head and
the selector, whose walk starts from the MTP draft.
Neither step reads a device value on the host: lane lengths and positions of committed rows are known from
`Observation` fields that are plain ints. The device form (`propose_lanes`, `observe_lanes`) does the same from
device tensors, sending each lane's rejected verify rows to the context's scratch lane.
"""

from __future__ import annotations

import dataclasses

import torch

from ignis.backends.base import BackendContext, Choice, Committed, Observation, Proposal, ProposeIn
from ignis.backends.dflash2.config import DrafterConfig
from ignis.backends.dflash2.context import ContextCache
from ignis.backends.dflash2 import greedy_copy, ring
from ignis.backends.dflash2.model import DrafterModel
from ignis.backends.dflash2.packed_head import for_spec
from ignis.backends.dflash2.selector import pick, select
from ignis.backends.dflash2.shortlist import ShortlistHead
from ignis.backends.dflash2.weights import SHORTLIST, load_drafter
from ignis.backends.mtp import Mtp
from ignis.errors import ConfigError
from ignis.kernels.launch import triton_installed
from ignis.logging import get_logger

log = get_logger(__name__)


class DFlash2:
    name = "dflash2"
    graph_safe = True

    def __init__(self, ctx: BackendContext, drafter: DrafterModel | None = None) -> None:
        """drafter: an already built drafter (benchmarks at shapes no file holds); None = load it from its directory."""
        spec = ctx.config.spec
        path = spec.drafter_dir(ctx.model_path)
        target = ctx.model.config
        self.cfg = cfg = DrafterConfig.from_dir(path, target) if drafter is None else drafter.config
        if spec.draft_tokens > cfg.width:
            raise ConfigError(
                "spec.draft_tokens",
                f"got {spec.draft_tokens}, but the drafter in {path} was trained for at most {cfg.width} drafts a round "
                f"(block_size {cfg.block_size}); set spec.draft_tokens to 1..{cfg.width}",
            )
        self.target = ctx.model
        self.device = ctx.device
        self.vocab = target.vocab_size
        self.draft_tokens = spec.draft_tokens
        self.tap_layers = cfg.target_layer_ids
        self.model = load_drafter(path, cfg, device=ctx.device, dtype=ctx.dtype) if drafter is None else drafter
        self.draft_weights = greedy_copy.resolve(spec.draft_weights, self.model, ctx.model, ctx.device)
        # the drafter greedy rounds of few rows read (.greedy_copy); None = every round reads `model`
        self.greedy_model: DrafterModel | None = None
        try:
            if self.draft_weights == "fp8":
                self.model.to_fp8()
            elif self.draft_weights == "int4":
                self.model.to_int4()
            elif self.draft_weights == "int4-greedy":
                self.greedy_model = greedy_copy.packed_copy(self.model)
        except ValueError as e:
            raise ConfigError("spec.draft_weights", f"int4 does not fit the drafter in {path}: {e}") from e
        if not ctx.model.exact:  # fewer, larger launches; exact mode keeps the reference arithmetic
            for model in (self.model, self.greedy_model):
                if model is not None:
                    model.fuse()
            self.model.rope.precompute(ctx.context + cfg.block_size + 1, ctx.device, ctx.dtype)  # the copy's too
        # "auto" made "full" or "int4"; the 4-bit head where it is "int4"
        self.draft_head, self.packed_head = for_spec(spec.draft_head, ctx.model, ctx.device)
        # the engine's reported config says which "auto" became
        self.settled_spec = {"draft_head": self.draft_head, "draft_weights": self.draft_weights}
        self.shortlist: ShortlistHead | None = None
        if self.draft_head == "shortlist":
            self.shortlist = ShortlistHead(path / SHORTLIST, hidden=target.hidden_size, vocab=self.vocab,
                                           device=ctx.device, dtype=ctx.dtype)
        self.cache = ContextCache(cfg, lanes=ctx.lanes, context=ctx.context, device=ctx.device, dtype=ctx.dtype)
        # slot 1's drafter where the drafter was trained with that slot given (first_draft "mtp"): the target's MTP
        # layer, its logits from the 4-bit head where the block's are (a shortlist would leave tokens out: not there)
        self.first: Mtp | None = Mtp(ctx, head=self.packed_head) if cfg.first_draft == "mtp" else None
        # The device round's attention and context writes read and write the rings in place (Triton kernels) on
        # CUDA outside the exact mode; tests switch it on for CPU tensors under Triton's interpreter.
        self.ring = (ctx.device.type == "cuda" and not ctx.model.exact and triton_installed()
                     and ring_fits(cfg, ctx.dtype))
        self.offsets = torch.arange(cfg.block_size, dtype=torch.long, device=ctx.device)  # [B] int64, device
        self.masks = torch.full((cfg.width,), cfg.mask_token_id, dtype=torch.long, device=ctx.device)  # [B-1] int64
        log.info(
            "ignis.runtime.draft_head",
            draft_head=self.draft_head,
            draft_weights=self.draft_weights,
            drafter=str(path),
            variant=cfg.variant,
            draft_tokens=self.draft_tokens,
            width=cfg.width,
            layers=cfg.num_layers,
            sliding_window=cfg.sliding_window,
            taps=list(cfg.target_layer_ids),
            shortlist_tokens=self.shortlist.size if self.shortlist is not None else None,
        )

    @property
    def observe_rows(self) -> int:
        """Most rows of one lane an `observe_lanes` call may carry: a sliding layer's ring holds no more."""
        return self.cache.ring

    def nbytes(self) -> int:
        held = {t.data_ptr(): t.nbytes for m in (self.model, self.greedy_model) if m is not None
                for t in (*m.parameters(), *m.buffers())}  # fp8 and 4-bit codes are buffers; the copy shares the rest
        weights = sum(held.values())
        head = self.shortlist.nbytes() if self.shortlist is not None else 0
        head += self.packed_head.nbytes() if self.packed_head is not None else 0
        first = self.first.nbytes() if self.first is not None else 0
        return weights + head + first + self.cache.nbytes() + self.offsets.nbytes + self.masks.nbytes

    def reset(self, lane: int) -> None:
        self.cache.reset(lane)
        if self.first is not None:
            self.first.reset(lane)

    def lane_views(self, lane: int, length: int) -> dict[str, torch.Tensor] | None:
        views = self.cache.lane_views(lane, length)
        if views is None or self.first is None:
            return views
        return views | {f"first.{k}": t for k, t in (self.first.lane_views(lane, length) or {}).items()}

    @torch.inference_mode()
    def observe(self, obs: list[Observation]) -> None:
        lanes: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        taps: list[torch.Tensor] = []
        positions: list[int] = []
        for o in obs:
            if o.taps is None:
                raise RuntimeError("dflash2 needs the target's tapped layer outputs; the round passed none")
            n = o.tokens.shape[0]
            skip = max(0, n - self.cache.keep)  # rows no layer of the drafter can show again
            lanes.append(o.lane)
            starts.append(o.start + skip)
            counts.append(n - skip)
            taps.append(o.taps[skip:])
            positions.extend(range(o.start + skip, o.start + n))
        if len(set(lanes)) != len(lanes):
            raise RuntimeError(f"observe got lanes {lanes}: at most one set of committed rows per lane and round")
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        kv = self.model.context_kv(torch.cat(taps), pos)
        self.cache.write(lanes, starts, counts, kv, self.device)
        if self.first is not None:
            self.first.observe(obs)

    @torch.inference_mode()
    def observe_lanes(self, rows: Committed, span: int) -> None:
        if rows.taps is None:
            raise RuntimeError("dflash2 needs the target's tapped layer outputs; the round passed none")
        b, c = rows.tokens.shape
        kept = torch.arange(c, device=self.device)[None, :] <= rows.accepted[:, None]  # [B, C]
        lane_ix = torch.where(kept, rows.lanes[:, None], self.cache.scratch).reshape(-1)
        positions = rows.positions.reshape(-1)
        taps = rows.taps.reshape(b * c, -1)
        if self.ring:
            ring.write(self.model, taps, positions, lane_ix, self.cache.rings())
        else:
            self.cache.write_rows(lane_ix, positions, self.model.context_kv(taps, positions))
        if self.first is not None:
            self.first.observe_lanes(rows, span)

    @torch.inference_mode()
    def propose(self, inp: ProposeIn) -> Proposal:
        """The round's inp.k drafts a lane, from a block of the drafter's full width whatever inp.k is: a block row
        sees the rows after it (non-causal layers), so a narrower block would draft a lane's first slots otherwise
        when the round's widest lane drafts fewer, and a sampled lane's tokens would follow the round's company. The
        device round's blocks are always this wide."""
        lane_ix = torch.tensor(inp.lanes, dtype=torch.long, device=self.device)
        k = self.draft_tokens
        choice = Choice.build(inp.temperatures, inp.generators, k, self.device, inp.cuts, inp.greedy_round,
                              inp.drafts if inp.drafts is not None else [inp.k] * len(inp.lanes))
        proposal = self._draft(lane_ix, inp.anchors, inp.positions, k, choice, inp.span)
        q = proposal.q[:, : inp.k] if proposal.q is not None else None
        return Proposal(tokens=proposal.tokens[:, : inp.k], q=q)

    @torch.inference_mode()
    def propose_lanes(self, lanes: torch.Tensor, anchors: torch.Tensor, positions: torch.Tensor, k: int,
                      choice: Choice, span: int) -> Proposal:
        return self._draft(lanes, anchors, positions, k, choice, span)

    def _draft(self, lane_ix: torch.Tensor, anchors: torch.Tensor, positions: torch.Tensor, k: int, choice: Choice,
               span: int) -> Proposal:
        if self.first is None:
            return self._block(lane_ix, anchors, positions, k, choice, span)
        # slot 1 from the MTP layer with the lanes' first uniforms; the block takes it as given and drafts slots 2..k
        # with the rest, its selector walking on from that draft
        first = self.first.propose_lanes(lane_ix, anchors, positions, 1, _slots(choice, 0, 1), span)
        if k == 1:
            return first
        rest = self._block(lane_ix, anchors, positions, k, _slots(choice, 1, k), span, given=first.tokens[:, 0])
        tokens = torch.cat([first.tokens, rest.tokens], dim=1)
        if first.q is None or rest.q is None:
            return Proposal(tokens=tokens, q=None)
        return Proposal(tokens=tokens, q=torch.cat([first.q, rest.q], dim=1))

    def _block(self, lane_ix: torch.Tensor, anchors: torch.Tensor, positions: torch.Tensor, k: int, choice: Choice,
               span: int, given: torch.Tensor | None = None) -> Proposal:
        """The block's drafts: slots 1..k, or with `given` (slot 1's drafts [n]) slots 2..k, the selector's walk
        starting from them."""
        model = self.greedy_model if self.reads_copy(choice.greedy_round, lane_ix.shape[0], k) else self.model
        hidden = self.hidden(lane_ix, anchors, positions, k, span, model, given)
        if given is not None:
            anchors = given
        candidates = None
        if self.shortlist is not None:
            logits, columns = self.shortlist.logits(hidden), self.shortlist.token_ids
        elif self.packed_head is not None:
            logits, columns = self.packed_head.logits(hidden), None
            candidates = self.packed_head.candidates
        else:
            logits, columns = self.target.logits(hidden), None
        if self.model.candidate_selector is not None:
            tokens, q = select(self.cfg, self.model.candidate_selector, hidden, logits, columns, anchors, choice,
                               self.vocab, candidates, fused=not self.target.exact)
        else:
            tokens, q = pick(self.cfg, logits, columns, choice, self.vocab)
        return Proposal(tokens=tokens, q=q)

    def reads_copy(self, greedy_round: bool, lanes: int, k: int) -> bool:
        """Whether a round of `lanes` blocks of k drafts drafts with the greedy copy (.greedy_copy.reads_copy)."""
        return self.greedy_model is not None and greedy_copy.reads_copy(greedy_round, lanes, k)

    def hidden(self, lane_ix: torch.Tensor, anchors: torch.Tensor, positions: torch.Tensor, k: int,
               span: int, model: DrafterModel | None = None, given: torch.Tensor | None = None) -> torch.Tensor:
        """The drafter's final-normed rows after each lane's anchor, [n, k, H], or with `given` after slot 1, [n, k - 1,
        H]. lane_ix, anchors, positions: [n] int64, device; span: a host bound on the rows any of these lanes has
        committed; model: the drafter's form that runs the block (the drafter as it is by default, or its greedy copy);
        given: slot 1's tokens [n] in place of its mask (a first_draft drafter's block)."""
        model = model if model is not None else self.model
        n = lane_ix.shape[0]
        q_pos = positions[:, None] + self.offsets[: k + 1]  # [n, k+1]
        lead = [anchors[:, None]] if given is None else [anchors[:, None], given[:, None]]
        ids = torch.cat([*lead, self.masks[: k + 1 - len(lead)].expand(n, k + 1 - len(lead))], dim=1)
        x = self.target.embed(ids)
        if self.cfg.input_embedding_scale != 1.0:
            x = x * self.cfg.input_embedding_scale
        # The anchor row proposes nothing, nor does a given slot 1. Contiguous, so the output head is one plain 2-D
        # product: on the strided view cuBLAS picked a kernel that read the 2.5 GB head once per 8 rows at 8 lanes
        # (4.7 ms, 27B shape, H200). One copy for both cuts.
        skip = len(lead)
        if self.ring:
            return ring.block(model, x, q_pos, self.cache.rings(), lane_ix, span)[:, skip:].contiguous()
        kv, masks = self.cache.gather(lane_ix, q_pos, span)
        return model.block(x, q_pos, kv, masks)[:, skip:].contiguous()


def _slots(choice: Choice, start: int, stop: int) -> Choice:
    """The choice of slots start..stop-1 only: their uniforms (a slot's draw reads its own column)."""
    if choice.uniforms is None:
        return choice
    return dataclasses.replace(choice, uniforms=choice.uniforms[:, start:stop])


def ring_fits(cfg: DrafterConfig, dtype: torch.dtype) -> bool:
    """The ring kernels (ignis.kernels.drafter_triton, imported here: call only where Triton is installed) take
    this drafter's heads in this dtype."""
    from ignis.kernels import drafter_triton

    return drafter_triton.fits(cfg.head_dim, cfg.rotary_dim, dtype)


def load(ctx: BackendContext) -> DFlash2:
    return DFlash2(ctx)
