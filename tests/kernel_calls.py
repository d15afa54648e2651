"""What the GPU tests ask of a kernel switch: which function a call went through."""

from __future__ import annotations

import pytest


def counted(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Wrap module.name so that each call appends to the returned list (which kernel a switch chose)."""
    calls: list[int] = []
    fn = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or fn(*a, **k))
    return calls
