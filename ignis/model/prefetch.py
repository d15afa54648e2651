"""The next weight's first bytes read into L2 while a decode round's small kernels run: `ahead`, `join`.

Owns: the switch (`BYTES`: how many bytes to ask for in each kind of window; None, off), the side stream a prefetch is
forked onto and its join back into the round's stream. Does not own: the kernel (ignis.kernels.l2_prefetch) or where
the windows are (the model's decode methods call `ahead` right after the product that opens one).

A window opens when a product has been launched and the next product waits behind small kernels: the conv, recurrence
and gated norm of a Gated DeltaNet layer or the q/k norms and attention of an attention layer ("mixer", before the
output projection), a residual add and norm ("mlp_in" before gate | up, "layer_in" before the next layer's input
projection) or the SwiGLU ("mlp_down"). `ahead` forks onto the side stream after what is on the round's stream so
far, so the prefetch starts as the product before the window ends and runs beside the window's kernels; nothing on
the round's stream waits for it until `join`, which a layer's decode calls at its end (a CUDA graph's capture needs the
side stream joined before it ends). The prefetch reads memory and writes none, so the round's results are the same
with it or without it.
"""

from __future__ import annotations

import threading

import torch

from ignis.kernels import l2_prefetch

WINDOWS = ("mixer", "mlp_in", "mlp_down", "layer_in")
# bytes asked for in each window, or None: off until a whole round measures it faster (tools.bench_round
# --prefetch); set once, before the engine captures its graphs
BYTES: dict[str, int] | None = None

_lock = threading.Lock()
_side: dict[torch.device, torch.cuda.Stream] = {}
_forked: set[torch.device] = set()


def _stream(device: torch.device) -> torch.cuda.Stream:
    with _lock:
        if device not in _side:
            _side[device] = torch.cuda.Stream(device)
        return _side[device]


def ahead(weight: object, window: str) -> None:
    """Ask for the first BYTES[window] bytes of a dense CUDA weight to be read into L2, beside what the round's stream
    runs next. Does nothing when off, for other windows' or quantized weights, or where the kernel does not run."""
    if BYTES is None or not isinstance(weight, torch.Tensor):
        return
    n = BYTES.get(window, 0)
    if n <= 0 or not l2_prefetch.fits(weight):
        return
    main = torch.cuda.current_stream(weight.device)
    side = _stream(weight.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        l2_prefetch.prefetch(weight, n)
    _forked.add(weight.device)


def join(device: torch.device) -> None:
    """Make the round's stream on `device` wait for every prefetch forked so far (they end as soon as they are issued,
    so this orders, it does not delay)."""
    if device not in _forked:
        return
    torch.cuda.current_stream(device).wait_stream(_stream(device))
    _forked.discard(device)
