"""What 4-bit weights cost a model: greedy agreement, logit error and perplexity of a quantized checkpoint against
the checkpoint it was made from, teacher-forced over held-out prompts (docs/quantization.md reports its output).

    python -m tools.quant_quality                         # the built-in model, int4 with groups of 128 and of 64
    python -m tools.quant_quality --model DIR --quantized DIR_INT4 --prompts my.jsonl

Per prompt the last --tokens tokens run as one prefill through both models (fp32 on the CPU unless --device says):
greedy agreement is the share of positions whose argmax token is the same; the logit error is the largest absolute
difference over all positions and tokens, divided by the largest absolute logit of the reference; perplexity is
exp(mean negative log-likelihood of each next token). Tokens a round with dflash2 come from tools.acceptance:
    python -m tools.acceptance --suite code --backend dflash2:7 --set model.path=DIR_INT4
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from ignis.artifact import BUILTIN
from ignis.model.batch import Batch, Segment
from ignis.model.cache import LaneCache
from ignis.model.loader import load_model
from ignis.model.model import HybridModel
from ignis.quant.convert import convert
from ignis.tokenizer import Tokenizer


def prefill_logits(model: HybridModel, ids: torch.Tensor) -> torch.Tensor:
    """ids [T] int64 (on the model's device) -> logits [T, V] float32 of one prefill on a fresh lane."""
    n = len(ids)
    dtype = model.embed_tokens.weight.dtype
    cache = LaneCache(model.config, lanes=1, context=n + 8, max_cols=1, device=ids.device, dtype=dtype)
    positions = torch.arange(n, device=ids.device)
    return model(Batch(ids, positions, (Segment(0, 0, 0, n),), positions), cache).logits


def compare(reference: HybridModel, quantized: HybridModel, prompts: list[list[int]]) -> dict[str, float]:
    same = total = 0
    worst = nll_ref = nll_q = 0.0
    device = reference.embed_tokens.weight.device
    for ids in prompts:
        x = torch.tensor(ids, device=device)
        a, b = prefill_logits(reference, x), prefill_logits(quantized, x)
        same += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(ids)
        worst = max(worst, float((a - b).abs().max() / a.abs().max()))
        nll_ref += float(F.cross_entropy(a[:-1], x[1:], reduction="sum"))
        nll_q += float(F.cross_entropy(b[:-1], x[1:], reduction="sum"))
    scored = total - len(prompts)
    return {"positions": total, "agreement": same / total, "max_rel_logit_error": worst,
            "ppl_reference": math.exp(nll_ref / scored), "ppl_quantized": math.exp(nll_q / scored)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BUILTIN, help="the checkpoint in its own precision")
    p.add_argument("--quantized", type=Path, action="append", default=[],
                   help="a quantized form of it (repeatable; default: made here with groups of 128 and 64)")
    p.add_argument("--prompts", type=Path, default=BUILTIN / "heldout_prompts.jsonl", help='JSONL with "prompt"')
    p.add_argument("--limit", type=int, default=16, help="prompts used (default 16)")
    p.add_argument("--tokens", type=int, default=256, help="last tokens of each prompt (default 256)")
    args = p.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(args.model)
    lines = args.prompts.read_text().splitlines()[: args.limit]
    prompts = [tok.encode(json.loads(line)["prompt"])[-args.tokens :] for line in lines]
    reference = load_model(args.model, device="cpu", dtype=torch.float32, exact=False)
    with tempfile.TemporaryDirectory() as scratch:
        targets = list(args.quantized)
        if not targets:
            for group in (128, 64):
                targets.append(Path(scratch) / f"int4-g{group}")
                convert(args.model, targets[-1], group=group)
        for path in targets:
            quantized = load_model(path, device="cpu", dtype=torch.float32, exact=False)
            size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6
            print(json.dumps({"quantized": path.name, "mb": round(size, 1), **compare(reference, quantized, prompts)}))


if __name__ == "__main__":
    main()
