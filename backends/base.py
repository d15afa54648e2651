"""The contract between the round and a speculation backend: one struct in, one struct out.

Owns: `BackendContext` (what a backend gets at load, the target's K/V pool among it), `Observation` (what was
committed), `ProposeIn` / `Proposal` (drafts for the lanes decoding this round), `Choice` (how each lane picks its
drafts), `Committed` (a device round's verify rows and how many each lane kept) and the `SpecBackend` protocol. Does not
own: the round itself (ignis.engine.round, ignis.engine.device_round), acceptance or discovery
(ignis.backends.registry).

The round calls, per lane and in this order: `reset` when a request takes the lane; `observe` after every forward with
the rows that lane committed (prefill chunks, or anchor plus accepted drafts) together with the token that follows
them; `propose` before the next verify. A backend never sees rejected drafts as committed.

Retained slots (ignis.engine.retain): a request that resumes a retained state takes its lane without `reset`, and
`lane_views` names every tensor of the backend's per-lane state that positions 0..n-1 (and the token after them)
left behind, so that the engine can copy it to the host and back. A backend whose state cannot be described that way
returns None, and its requests are always prefilled whole.

Two forms of propose and observe: the host form (`propose`, `observe`: lists and host ints, any shapes; prefill and
the reference round use it) and, for backends with `graph_safe = True`, the device form (`propose_lanes`,
`observe_lanes`: device tensors only, static shapes for a bucket of B lanes, no host read) that a CUDA graph captures.
In the device form every lane's rows come as [B, C] and the backend itself keeps rows 0..accepted of each lane,
sending the rest to the scratch lane (index `lanes`) of its own per-lane buffers. The device prefill
(ignis.engine.device_prefill) hands a prompt to `observe_lanes` too, in pieces of one lane and up to 256 rows, all
kept; a backend whose per-lane buffers hold fewer rows (a ring) names its limit as an `observe_rows` attribute. A
backend without `graph_safe` runs every round through the host form.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from ignis.engine.device_sampling import shape_probs
from ignis.kernels.launch import triton_installed

if TYPE_CHECKING:
    from ignis.config import IgnisConfig
    from ignis.model.decode import DecodeStep
    from ignis.model.model import HybridModel
    from ignis.model.pool import KVPool


@dataclass(frozen=True)
class BackendContext:
    model: HybridModel  # the target: backends share its embedding and output head
    config: IgnisConfig
    model_path: Path  # the artifact directory (a drafter lives in <model_path>/drafter unless spec.drafter says)
    lanes: int
    context: int
    device: torch.device
    dtype: torch.dtype
    # The target's K/V pool (ignis.model.pool): a backend layer that attends at the target's positions can keep its
    # keys there (`kv.layer()`), in the pages the target's lane holds, read through the same block table; the engine
    # sizes the pool once every layer is known. None: no pool (a backend built outside an engine keeps its own).
    kv: KVPool | None = None


@dataclass
class Observation:
    """Rows one lane committed in the last forward: tokens at positions start..start+n-1, and the token after them."""

    lane: int
    start: int
    tokens: torch.Tensor  # [n] int64, device
    following: int  # token at position start+n (the next anchor, or the next prompt token)
    hidden: torch.Tensor  # [n, H] model dtype, device: final-normed hidden states of those rows
    taps: torch.Tensor | None  # [n, len(tap_layers) * H] model dtype, device: tapped layer outputs, if asked


@dataclass
class ProposeIn:
    lanes: list[int]
    anchors: torch.Tensor  # [n] int64, device: each lane's last committed token, not yet run through the model
    positions: torch.Tensor  # [n] int64, device: the anchors' positions
    k: int  # drafts wanted per lane
    temperatures: list[float]  # per lane; 0 = the request is greedy (draft deterministically, q may be None)
    generators: list[torch.Generator]  # per lane, for backends that sample their drafts
    cuts: list[tuple[int, float, float]] | None = None  # per lane: the request's (top_k, top_p, min_p); None = none
    span: int = 0  # the largest anchor position among the lanes (rows any lane has committed)
    greedy_round: bool = False  # every lane takes the target's argmax (Choice.greedy_round)
    drafts: list[int] | None = None  # per lane: the drafts it keeps this round (at most k); None = k each


@dataclass
class Proposal:
    tokens: torch.Tensor  # [n, k] int64, device
    q: torch.Tensor | None  # [n, k, V] float32: draft distribution per slot; None = one-hot at `tokens`


DRAW_COLUMNS = 64  # the most columns Choice.draw sends to one Triton launch (ignis.kernels.draw_triton.MAX_COLUMNS)


@dataclass(frozen=True)
class Choice:
    """How each lane chooses its drafts: temperature 0 is greedy; others draw with their uniforms from the drafter's
    distribution shaped the way the request shapes the target's (temperature, then its top-k, top-p and min-p cuts).

    Rejection sampling stays exact for any q the drafts are drawn from; a q cut like p puts no mass on tokens that p
    gives none, which the target would reject every time."""

    temperatures: torch.Tensor  # [n] float32, device
    uniforms: torch.Tensor | None  # [n, k] float64, device: one per slot; None = every lane greedy
    top_k: torch.Tensor | None = None  # [n] int64, device: 0 = off; None (with top_p and min_p) = no lane cuts
    top_p: torch.Tensor | None = None  # [n] float32, device: 1 = off
    min_p: torch.Tensor | None = None  # [n] float32, device: 0 = off
    # Every lane of the round takes the target's argmax: the drafts change only how many are kept, never the output,
    # so a backend may draft with a cheaper approximation (dflash2's spec.draft_weights = "int4-greedy").
    greedy_round: bool = False

    @staticmethod
    def build(temperatures: list[float], generators: list[torch.Generator], k: int, device: torch.device,
              cuts: list[tuple[int, float, float]] | None = None, greedy_round: bool = False,
              drafts: list[int] | None = None) -> Choice:
        """The host form: uniforms from each sampling lane's own generator, as many as the drafts it keeps (`drafts`,
        per lane; None: k each), the slots past them zero: a lane draws the same randomness whatever the round's
        other lanes draft. `cuts` holds each lane's (top_k, top_p, min_p)."""
        temps = torch.tensor(temperatures, dtype=torch.float32, device=device)
        if all(t <= 0.0 for t in temperatures):
            return Choice(temps, None, greedy_round=greedy_round)
        own = drafts if drafts is not None else [k] * len(temperatures)
        rows = [torch.cat([torch.rand(min(n, k), generator=g, dtype=torch.float64),
                           torch.zeros(k - min(n, k), dtype=torch.float64)])
                if t > 0.0 else torch.zeros(k, dtype=torch.float64)
                for t, g, n in zip(temperatures, generators, own, strict=True)]
        uniforms = torch.stack(rows).to(device, non_blocking=True)
        if not cuts:
            return Choice(temps, uniforms, greedy_round=greedy_round)
        top_k, top_p, min_p = zip(*cuts)
        return Choice(temps, uniforms, torch.tensor(top_k, dtype=torch.int64, device=device),
                      torch.tensor(top_p, dtype=torch.float32, device=device),
                      torch.tensor(min_p, dtype=torch.float32, device=device), greedy_round)

    def probs(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [n, C] or [n, k, C] float32 -> each lane's draft distribution over the C columns, the same shape:
        softmax(scores / T) within the lane's cuts, renormalised (rows of greedy lanes are shaped at T = 1, unused)."""
        n, width = scores.shape[0], scores.shape[-1]
        slots = scores.numel() // max(1, n * width)
        zeros = torch.zeros_like(self.temperatures)
        top_k = self.top_k if self.top_k is not None else zeros.long()
        top_p = self.top_p if self.top_p is not None else torch.ones_like(self.temperatures)
        min_p = self.min_p if self.min_p is not None else zeros
        rows = [t.repeat_interleave(slots) for t in (self.temperatures, top_k, top_p, min_p)]
        return shape_probs(scores.reshape(-1, width), *rows).view(scores.shape)

    def draw(self, scores: torch.Tensor, greedy: torch.Tensor, slot: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(q over the C columns, chosen column) for scores [n, C] or [n, k, C] float32 and their argmax `greedy`
        (scores' shape without C): sampling lanes draw by inverse CDF of their `probs` at their uniforms of `slot`
        (None: scores hold every slot); greedy lanes keep the argmax and get a one-hot q, so q always says how the
        draft was chosen. Needs `uniforms`."""
        assert self.uniforms is not None
        u = self.uniforms[:, slot] if slot is not None else self.uniforms
        if scores.is_cuda and scores.shape[-1] <= DRAW_COLUMNS and triton_installed():
            return self._draw_in_one_launch(scores, greedy, u)
        sampling = self.temperatures > 0
        probs = self.probs(scores)
        cdf = torch.cumsum(probs.double(), dim=-1)
        drawn = torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1), right=True).squeeze(-1)
        drawn = drawn.clamp(max=scores.shape[-1] - 1)
        lanes = sampling.view((-1,) + (1,) * (greedy.dim() - 1))
        chosen = torch.where(lanes, drawn, greedy)
        one_hot = torch.zeros_like(probs).scatter_(-1, greedy.unsqueeze(-1), 1.0)
        return torch.where(lanes.unsqueeze(-1), probs, one_hot), chosen

    def _draw_in_one_launch(self, scores: torch.Tensor, greedy: torch.Tensor,
                            u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`draw` on CUDA: every row's shaping and inverse CDF in one Triton launch (ignis.kernels.draw_triton), the
        torch path above its reference."""
        from ignis.kernels.draw_triton import shaped_draw

        n, width = scores.shape[0], scores.shape[-1]
        slots = scores.numel() // max(1, n * width)
        zeros = torch.zeros_like(self.temperatures)
        cuts = (self.top_k if self.top_k is not None else zeros.long(),
                self.top_p if self.top_p is not None else torch.ones_like(self.temperatures),
                self.min_p if self.min_p is not None else zeros)
        rows = [t.repeat_interleave(slots) for t in (self.temperatures, *cuts)]
        q, chosen = shaped_draw(scores.reshape(-1, width), *rows, u.reshape(-1), greedy.reshape(-1))
        return q.view(scores.shape), chosen.view(greedy.shape)


@dataclass(frozen=True)
class Committed:
    """A device round's verify rows for B lanes x C columns, and how many rows each lane kept."""

    lanes: torch.Tensor  # [B] int64, device (padding: the scratch lane)
    positions: torch.Tensor  # [B, C] int64, device
    tokens: torch.Tensor  # [B, C] int64, device: anchor, d1..dK
    following: torch.Tensor  # [B, C] int64, device: the token after each row (valid for kept rows)
    hidden: torch.Tensor  # [B, C, H] model dtype, device: final-normed hidden states
    taps: torch.Tensor | None  # [B, C, len(tap_layers) * H] model dtype, device
    accepted: torch.Tensor  # [B] int64, device: rows 0..accepted are kept
    # the forward's own DecodeStep over these rows (lanes, positions, span): a backend's layer attending at the same
    # positions reads its RoPE tables rather than gathering them again; None: build them
    step: DecodeStep | None = None


class SpecBackend(Protocol):
    """A speculative backend. Optionally it also has `settled_spec: dict[str, str]`, the spec keys it settled at
    load from "auto" (dflash2's draft_head), which the engine writes into the config it reports."""

    name: str
    draft_tokens: int  # K per round (0 for off)
    tap_layers: tuple[int, ...]  # target decoder layers whose outputs `observe` needs (empty: none)
    graph_safe: bool  # propose_lanes / observe_lanes exist and read no host value

    def nbytes(self) -> int:
        """Device memory the backend holds (weights of its own plus per-lane caches)."""
        ...

    def reset(self, lane: int) -> None: ...

    def lane_views(self, lane: int, length: int) -> dict[str, torch.Tensor] | None:
        """Views (not copies) of everything the backend keeps for `lane` after committing positions 0..length-1, by
        name; writing saved copies back into them restores the lane. None: this backend cannot retain."""
        ...

    def observe(self, obs: list[Observation]) -> None: ...

    def propose(self, inp: ProposeIn) -> Proposal: ...

    def propose_lanes(
        self,
        lanes: torch.Tensor,  # [B] int64, device
        anchors: torch.Tensor,  # [B] int64, device
        positions: torch.Tensor,  # [B] int64, device: the anchors' positions
        k: int,
        choice: Choice,
        span: int,  # key slots the target's attention reads this round (> every position in the round)
    ) -> Proposal:
        """Device form of `propose` (graph_safe backends)."""
        ...

    def observe_lanes(self, rows: Committed, span: int) -> None:
        """Device form of `observe` (graph_safe backends)."""
        ...
