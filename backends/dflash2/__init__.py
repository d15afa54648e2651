"""ignis.backends.dflash2: the DFlash-family block drafter (DFlash2 with convs and selector, or plain DFlash).

Modules: config (config.json), weights (safetensors in and out), model (the drafter network), context (per-lane
drafter K/V), selector (choosing drafts and q), shortlist (the 4-bit proposal head), backend (the round's steps).
`load` is the entry point registered under `ignis.spec_backends`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ignis.backends.base import BackendContext
    from ignis.backends.dflash2.backend import DFlash2


def load(ctx: BackendContext) -> DFlash2:
    from ignis.backends.dflash2.backend import DFlash2

    return DFlash2(ctx)
