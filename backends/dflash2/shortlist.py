"""The shortlist proposal head: the target's output rows for the N most frequent tokens, quantized to 4 bits.

Owns: the file format (`<drafter>/shortlist.safetensors`), quantizing and packing a head, reading it back, and the
logits it gives. Does not own: choosing the N tokens (tools/artifact/build_shortlist.py counts them) or what the
drafter does with the logits (.selector).

Format: `weight_q4` [N, H/2] uint8, two signed 4-bit codes per byte (column 2j in the low nibble, 2j+1 in the
high one, each stored as code + 8); `scales` [N, H/group] float16, one per group of `group` columns, weight =
code * scale (symmetric, codes -8..7, scale = max|w| / 7 over the group); `token_ids` [N] int64, the target ids of
the rows, all distinct. The metadata holds `group_size`. A token outside the shortlist can never be proposed.

The head is dequantized once at load: the logits are exactly those of the 4-bit weights, and the GEMM reads a
dense copy until a fused 4-bit kernel is measured to be worth having.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ignis.errors import ArtifactError


def quantize(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, H] -> (packed [N, H/2] uint8, scales [N, H/group] float16)."""
    n, h = weight.shape
    if h % group or group % 2:
        raise ValueError(f"group size {group} must be even and divide the hidden size {h}")
    w = weight.detach().float().view(n, h // group, group)
    scales = (w.abs().amax(dim=-1) / 7.0).to(torch.float16)
    safe = scales.float().clamp_min(torch.finfo(torch.float16).tiny)[..., None]
    codes = torch.clamp(torch.round(w / safe), -8, 7).to(torch.int16).view(n, h) + 8
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, scales


def dequantize(packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """(packed [N, H/2] uint8, scales [N, H/group]) -> weight [N, H] float32."""
    n = packed.shape[0]
    low = (packed & 0x0F).to(torch.int16) - 8
    high = (packed >> 4).to(torch.int16) - 8
    codes = torch.stack([low, high], dim=-1).view(n, -1).float()
    return (codes.view(n, scales.shape[1], group) * scales.float()[..., None]).view(n, -1)


def save_shortlist(path: Path, weight: torch.Tensor, token_ids: torch.Tensor, group: int = 32) -> None:
    """weight [N, H]: the target's output-head rows of `token_ids` [N], in that order."""
    if token_ids.unique().numel() != token_ids.numel():
        raise ValueError("shortlist token ids must be distinct")
    packed, scales = quantize(weight, group)
    tensors = {"weight_q4": packed, "scales": scales, "token_ids": token_ids.to(torch.int64).contiguous()}
    save_file(tensors, str(path), metadata={"format": "pt", "group_size": str(group)})


class ShortlistHead:
    def __init__(self, path: Path, *, hidden: int, vocab: int, device: torch.device, dtype: torch.dtype) -> None:
        if not path.is_file():
            raise ArtifactError(
                f"spec.draft_head 'shortlist' needs {path}, which does not exist; build it with "
                "tools/artifact/build_shortlist.py or use spec.draft_head='full'"
            )
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                names = set(f.keys())
                missing = sorted({"weight_q4", "scales", "token_ids"} - names)
                if missing:
                    raise ArtifactError(f"{path}: missing tensors {', '.join(missing)}")
                packed, scales, ids = f.get_tensor("weight_q4"), f.get_tensor("scales"), f.get_tensor("token_ids")
            group = int(meta["group_size"])
        except (KeyError, ValueError, OSError) as e:
            raise ArtifactError(f"{path}: not a shortlist head ({e}); metadata must hold group_size") from e
        n = ids.shape[0]
        ok = (packed.dtype == torch.uint8 and tuple(packed.shape) == (n, hidden // 2) and group > 0
              and hidden % group == 0 and tuple(scales.shape) == (n, hidden // group) and ids.dim() == 1)
        if not ok:
            raise ArtifactError(
                f"{path}: weight_q4 {tuple(packed.shape)} {packed.dtype}, scales {tuple(scales.shape)}, token_ids "
                f"{tuple(ids.shape)}, group_size {group}: expected [N, {hidden // 2}] uint8, [N, {hidden}/group], [N]"
            )
        if n == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != n:
            raise ArtifactError(f"{path}: token_ids must be {n} distinct ids of the target's {vocab}-token vocabulary")
        self.path = path
        self.weight = dequantize(packed, scales, group).to(device=device, dtype=dtype)  # [N, H] model dtype, device
        self.token_ids = ids.to(device)  # [N] int64, device: target id of each row
        self.size = n

    def nbytes(self) -> int:
        return self.weight.nbytes + self.token_ids.nbytes

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> [..., N] float32 over the shortlist's rows."""
        return torch.nn.functional.linear(hidden, self.weight).float()
