"""The built-in artifact: a small Python-code model in the Qwen3.5 text layout, shipped inside the package.

Owns: the files of the default model (config.json, safetensors shards, tokenizer, MTP weights under `mtp.*`, and
the dflash2 drafter under `drafter/`), and `PATH`, where they are once installed. Does not own: reading them
(ignis.model.loader) or rebuilding them (tools/artifact/, whose README holds the commands). ARTIFACT.md here is
the model card.
"""

from __future__ import annotations

from pathlib import Path

PATH: Path = Path(__file__).resolve().parent
