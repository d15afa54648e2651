"""The Qwen3.5-27B's config.json files (no weights) with a dflash2 drafter of its width: what memory plans and the
engine's defaults are tested at."""

from __future__ import annotations

import json
from pathlib import Path

from ignis.model.random import _full_config
from ignis.quant.format import QuantConfig
from tools.round_work import QWEN35_27B

BUILTIN_DRAFTER = Path(__file__).resolve().parents[1] / "ignis" / "builtin" / "drafter" / "config.json"


def write_27b(root: Path, int4: bool, head: bool = False) -> Path:
    """The 27B's config.json (with its MTP layer; 4-bit projections, and with `head` its output head too) and its
    dflash2 drafter's: 5 layers of the target's width, in the published form (its own slot 1: no first_draft, whatever
    form the built-in drafter ships in), as `ignis train-drafter` makes one from scratch and z-lab publishes them."""
    root.mkdir(parents=True)
    cfg = _full_config(QWEN35_27B, mtp=True)
    if int4:
        cfg["quantization_config"] = QuantConfig(group_size=128, head=head).to_json()
    (root / "config.json").write_text(json.dumps(cfg))
    drafter = json.loads(BUILTIN_DRAFTER.read_text())
    drafter.update(hidden_size=5120, intermediate_size=17408, num_attention_heads=32, num_key_value_heads=8,
                   head_dim=128, num_target_layers=64, vocab_size=248320)
    drafter["dflash_config"].update(target_layer_ids=[1, 16, 31, 46, 61], mask_token_id=248077)
    drafter["dflash_config"].pop("first_draft", None)
    (root / "drafter").mkdir()
    (root / "drafter" / "config.json").write_text(json.dumps(drafter))
    return root
