"""Train the built-in dflash2 drafter on completions the built-in target generates itself, within a time budget.

Owns: the drafter's shape, the DFlash block recipe (random anchors in the completions, the block mask, loss weights
decaying with the slot, gamma 4 for blocks of 8) plus the candidate selector's loss, the run (generation, tap
features, AdamW + cosine fitted to the budget, held-out evaluation, the log) and its outputs. Does not own: the
drafter network (ignis.backends.dflash2.model, the same module ignis runs), on-policy data (drafter_data.py) or the
shortlist head (build_shortlist.py).

    python -m tools.artifact.train_drafter --out build/drafter --time-budget 400          # one GPU
    python -m tools.artifact.train_drafter --toy --out /tmp/toy-drafter                   # CPU smoke run

Recipe (research/dflash.md §4, dflash2.md §4): a block [x_a, MASK x 7] at positions a..a+7 sees the target's tapped
features of positions < a and its own rows; slot k predicts x_{a+k} with weight exp(-(k-1)/gamma). The selector is
trained teacher-forced (its predecessor is the true previous token) as a K-way choice among the unary top-K, the
true token put in place of the K-th candidate when it is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import Qwen3_5ForCausalLM

from ignis.backends.dflash2.config import DrafterConfig, drafter_config_json
from ignis.backends.dflash2.model import DrafterModel, block_mask
from ignis.backends.dflash2.selector import transform
from ignis.backends.dflash2.weights import save_drafter
from ignis.model.config import ModelConfig
from tools.artifact import corpus, drafter_data
from tools.artifact.train_target import Log
from tools.artifact.train_tokenizer import MASK_ID

SHAPE: dict[str, object] = {"num_layers": 5, "sliding_window": 2048, "block_size": 8, "intermediate_size": 1024,
                            "target_layer_ids": [1, 3, 5, 6, 7], "selector_rank": 64, "selector_top_k": 16}
TOY_SHAPE: dict[str, object] = {**SHAPE, "num_layers": 2, "intermediate_size": 256, "selector_rank": 16}
GAMMA = 4.0
SELECTOR_WEIGHT = 1.0
WARMUP_STEPS = 100
RESERVE_S = 20.0  # evaluation and writing files after the last step


def losses(model: DrafterModel, embed: torch.Tensor, taps: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
           anchors: torch.Tensor) -> dict[str, torch.Tensor]:
    """taps [b, S, F], tokens [b, S] int64, mask [b, S] bool (completion tokens), anchors [b, N] int64; embed [V, H]
    the target's (tied) embedding and head. Returns the losses and teacher-forced acceptance counts."""
    cfg = model.config
    b, seq = tokens.shape
    k, dev = cfg.width, tokens.device
    pos = torch.arange(seq, device=dev)
    kv = model.context_kv(taps.reshape(b * seq, -1), pos.repeat(b))  # computed once per position
    owner = torch.arange(b, device=dev).repeat_interleave(anchors.shape[1])  # [n]: sequence of each block
    a = anchors.reshape(-1)
    q_pos = a[:, None] + torch.arange(k + 1, device=dev)  # [n, B]
    at = q_pos[:, 1:].clamp(max=seq - 1)
    labels = tokens[owner[:, None], at]  # [n, k]
    valid = mask[owner[:, None], at] & (q_pos[:, 1:] < seq)
    ids = torch.cat([tokens[owner, a][:, None], torch.full_like(labels, cfg.mask_token_id)], dim=1)
    x = F.embedding(ids, embed) * cfg.input_embedding_scale
    ctx = [(kk.view(b, seq, *kk.shape[1:])[owner], vv.view(b, seq, *vv.shape[1:])[owner]) for kk, vv in kv]
    masks = [block_mask(cfg, i, pos.expand(a.shape[0], -1), q_pos) for i in range(cfg.num_layers)]
    hidden = model.block(x, q_pos, ctx, masks)[:, 1:]  # [n, k, H]
    logits = transform(cfg, F.linear(hidden, embed).float())  # [n, k, V]
    weight = torch.exp(-torch.arange(k, device=dev) / GAMMA) * valid  # [n, k]
    norm = weight.sum().clamp_min(1e-6)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    out = {"unary": (ce.view_as(weight) * weight).sum() / norm}
    unary_pick = logits.argmax(-1)
    if model.candidate_selector is not None:
        sel = model.candidate_selector
        cand = logits.detach().topk(cfg.selector_top_k, dim=-1).indices  # [n, k, K]: the serving set
        missing = ~(cand == labels[..., None]).any(-1)
        cand[..., -1] = torch.where(missing, labels, cand[..., -1])
        target = (cand == labels[..., None]).int().argmax(-1)  # [n, k]
        prev = torch.cat([ids[:, :1], labels[:, :-1]], dim=1)  # teacher forcing: the true previous token
        hp = sel.hidden_projection(hidden)
        edge = torch.einsum("nkr,nkcr->nkc", sel.predecessor_codebook[prev] * hp, sel.successor_codebook[cand])
        scores = logits.gather(-1, cand) + edge.float()
        sce = F.cross_entropy(scores.reshape(-1, scores.shape[-1]), target.reshape(-1), reduction="none")
        out["selector"] = (sce.view_as(weight) * weight).sum() / norm
        out["loss"] = out["unary"] + SELECTOR_WEIGHT * out["selector"]
        chosen = cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
    else:
        out["loss"] = out["unary"]
        chosen = unary_pick
    full = valid.all(-1)  # blocks whose every slot has a label: their accepted length is defined
    for name, pick in (("unary", unary_pick), ("selector", chosen)):
        run = torch.cumprod((pick == labels).int(), dim=1).sum(-1)
        out[f"accepted_{name}"] = (run * full).sum().float()
    out["blocks"] = full.sum().float()
    return out


def anchors_for(b: int, seq: int, prompt: int, n: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """[b, n] distinct anchors per sequence in the completion (the first one is the first generated token)."""
    order = torch.rand(b, seq - 1 - prompt, generator=gen).argsort(dim=-1)[:, :n]
    return (order + prompt).to(device)


@torch.no_grad()
def evaluate(model: DrafterModel, embed: torch.Tensor, taps: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
             greedy: torch.Tensor, prompt: int, batch: int) -> dict[str, float]:
    """Teacher-forced acceptance on held-out completions, every 4th anchor: with greedy completions the accepted
    run equals what greedy verification keeps, so 1 + accepted/blocks is tokens per round."""
    model.eval()
    sums: dict[str, float] = {}
    stride = 4
    for start in range(0, tokens.shape[0], batch):
        sl = slice(start, start + batch)
        b, seq = tokens[sl].shape
        anchors = torch.arange(prompt, seq - 1 - model.config.width, stride, device=tokens.device).expand(b, -1)
        for is_greedy in (True, False):
            rows = greedy[sl] if is_greedy else ~greedy[sl]
            if not rows.any():
                continue
            with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=tokens.device.type == "cuda"):
                out = losses(model, embed, taps[sl][rows], tokens[sl][rows], mask[sl][rows], anchors[rows])
            tag = "greedy" if is_greedy else "sampled"
            for key in ("accepted_unary", "accepted_selector", "blocks"):
                sums[f"{tag}_{key}"] = sums.get(f"{tag}_{key}", 0.0) + float(out[key])
    model.train()
    result = {}
    for tag in ("greedy", "sampled"):
        blocks = max(sums.get(f"{tag}_blocks", 0.0), 1.0)
        for name in ("unary", "selector"):
            result[f"{tag}_tokens_per_round_{name}"] = 1.0 + sums.get(f"{tag}_accepted_{name}", 0.0) / blocks
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--target", type=Path, default=Path("ignis/builtin"))
    ap.add_argument("--time-budget", type=float, default=400.0, help="seconds, from start to files written")
    ap.add_argument("--sequences", type=int, default=16384, help="prompts to complete")
    ap.add_argument("--prompt-len", type=int, default=384)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--gen-batch", type=int, default=2048)
    ap.add_argument("--gen-share", type=float, default=0.35, help="share of the budget generation may take")
    ap.add_argument("--batch", type=int, default=32, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=32, help="blocks per sequence per step")
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--toy", action="store_true", help="small drafter, few stdlib files: a CPU smoke run")
    args = ap.parse_args()

    t0 = time.monotonic()
    deadline = t0 + args.time_budget
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "train.log")
    log(f"torch {torch.__version__}; args {vars(args)}")
    tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    roots = corpus.default_roots(site_packages=not args.toy)
    train_files = drafter_data.sample_files(roots, 40_000_000 if not args.toy else 2_000_000)
    prompts = drafter_data.build_prompts(tok, train_files, args.sequences, args.prompt_len, 0.3, args.seed)
    log(f"{prompts.shape[0]} prompts of {args.prompt_len} tokens from {len(train_files)} training files")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    net: Any = Qwen3_5ForCausalLM.from_pretrained(args.target, dtype=dtype)
    net = net.to(device).eval().requires_grad_(False)
    gen_deadline = t0 + args.gen_share * args.time_budget
    tokens, mask, greedy = drafter_data.generate(net, prompts, args.gen_len, args.gen_batch, device, args.seed, log,
                                                gen_deadline)
    target = ModelConfig.from_dir(args.target)
    shape = dict(TOY_SHAPE if args.toy else SHAPE)
    config = drafter_config_json(target, mask_token_id=MASK_ID, **shape)  # type: ignore[arg-type]
    cfg = DrafterConfig.from_dict(config, target)
    taps = drafter_data.tap_features(net, tokens, cfg.target_layer_ids, 256, device, dtype)
    embed = net.model.embed_tokens.weight.detach()
    tokens, mask, greedy = tokens.to(device), mask.to(device), greedy.to(device)
    log(f"data: {tokens.shape[0]} sequences, {int(mask.sum())} completion tokens; taps {tuple(taps.shape)}")
    # Every 25th sequence is held out, so every generation batch (each decoded in one mode) is represented.
    is_held = torch.arange(tokens.shape[0], device=device) % 25 == 0
    held, train = is_held.nonzero()[:, 0], (~is_held).nonzero()[:, 0]

    torch.manual_seed(args.seed)
    model = DrafterModel(cfg).to(device)
    params = sum(p.numel() for p in model.parameters())
    log(f"drafter: {params / 1e6:.2f}M parameters, bf16 {params * 2 / 2**20:.1f} MiB")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    total, step, timed_from = args.max_steps or 10**9, 0, 0.0
    batch = min(args.batch, train.numel())
    while step < total and time.monotonic() < deadline - RESERVE_S:
        if step == 10:
            timed_from = _sync_time(device)
        if step == 40 and not args.max_steps:
            per_step = (_sync_time(device) - timed_from) / 30
            total = 40 + int((deadline - RESERVE_S - time.monotonic()) / per_step)
            log(f"{per_step * 1000:.0f} ms/step: {total} steps fit the budget")
        lr = args.lr * min(1.0, (step + 1) / WARMUP_STEPS)
        if step >= WARMUP_STEPS and total < 10**9:
            lr = args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP_STEPS) / (total - WARMUP_STEPS)))))
        for group in opt.param_groups:
            group["lr"] = lr
        rows = train[torch.randint(train.numel(), (batch,), generator=gen).to(device)]
        anchors = anchors_for(batch, tokens.shape[1], args.prompt_len, args.anchors, gen, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = losses(model, embed, taps[rows], tokens[rows], mask[rows], anchors)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 100 == 0 or step <= 3:
            seen = {key: v.item() for key, v in out.items()}
            tau = 1.0 + seen["accepted_selector"] / max(seen["blocks"], 1.0)
            log(f"step {step} loss {seen['loss']:.4f} unary {seen['unary']:.4f} selector "
                f"{seen.get('selector', 0.0):.4f} tau {tau:.2f} gnorm {norm.item():.2f} lr {lr:.2e}")

    result = evaluate(model, embed, taps[held], tokens[held], mask[held], greedy[held], args.prompt_len, 64)
    save_drafter(args.out / "drafter", config, model, torch.bfloat16)
    counts = torch.bincount(tokens[train][mask[train]].reshape(-1), minlength=target.vocab_size)
    np.save(args.out / "counts.npy", counts.cpu().numpy())
    summary = {"steps": step, "sequences": tokens.shape[0], "held_out_sequences": held.numel(),
               "completion_tokens": int(mask.sum()), "params": params, "seconds": time.monotonic() - t0,
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", **result}
    log("summary " + json.dumps(summary))


def _sync_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.monotonic()


if __name__ == "__main__":
    main()
