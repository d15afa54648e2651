"""`ignis train-drafter`: a dflash2 drafter for any Qwen3.5 checkpoint ignis loads, from the user's prompts.

Owns: the run, phase by phase: read and split the prompts, let the target complete them (ignis.train.generate), tap
its layers (ignis.train.taps, cached when they fit), train (ignis.train.loop) under the budget, write the drafter in
the DFlash2 layout (and the shortlist head), evaluate it against `off` through the engine (ignis.train.evaluate), and
leave a summary. Does not own: any of those phases' insides.

DIR is the drafter directory (`spec.drafter = DIR`): config.json, safetensors, optionally shortlist.safetensors and
train_summary.json. DIR/run keeps what a resumed run needs: settings.json, the generated data, checkpoint.pt and
train.log. Running the same command again continues where the last one stopped; other settings are refused.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ignis.artifact import BUILTIN
from ignis.backends.dflash2.config import DrafterConfig, drafter_config_json
from ignis.backends.dflash2.model import DrafterModel
from ignis.backends.dflash2.weights import SHORTLIST, load_drafter, save_drafter, spread_layer_ids
from ignis.config import load_config, parse_overrides
from ignis.engine.core import Engine
from ignis.errors import ArtifactError, InputError
from ignis.model.config import ModelConfig, read_config_json
from ignis.model.ops import dense
from ignis.tokenizer import Tokenizer
from ignis.train import generate, memory, prompts, recipe, shortlist
from ignis.train.evaluate import evaluate
from ignis.train.loop import Budget, Loop, Recipe
from ignis.train.options import FIRST_DRAFT_FORMS, Options
from ignis.train.taps import tap_features

MASK_NAMES = ("<|mask|>", "<|MASK|>", "<mask>", "[MASK]")


class Log:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, line: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        with self.path.open("a") as f:
            f.write(f"{stamp} {line}\n")
        clear = "\r\x1b[K" if sys.stderr.isatty() else ""  # over a progress bar's line
        print(f"{clear}ignis train-drafter: {line}", file=sys.stderr, flush=True)


def grown(cfg_json: dict[str, Any], layers: int) -> dict[str, Any]:
    """A drafter's config.json with `layers` more layers, each of the last one's type."""
    out = json.loads(json.dumps(cfg_json))
    n = int(out["num_hidden_layers"])
    out["num_hidden_layers"] = n + layers
    if out.get("layer_types"):
        out["layer_types"] = list(out["layer_types"]) + [out["layer_types"][-1]] * layers
    return out


def load_grown(drafter: DrafterModel, start: DrafterModel) -> None:
    """`start`'s weights into `drafter`, which may hold more layers after start's own: each of those keeps its fresh
    weights but for its attention's and MLP's output projections, zeroed, so that it adds nothing to the residual and
    the grown drafter computes start's function (the DFlash2 convs after them are linear in their outputs)."""
    missing, unexpected = drafter.load_state_dict(start.state_dict(), strict=False)
    own = len(start.layers)
    if unexpected or any(not k.startswith("layers.") or int(k.split(".")[1]) < own for k in missing):
        raise ArtifactError(f"--init: its tensors do not fit the grown drafter (missing {missing[:4]}, unexpected "
                            f"{unexpected[:4]})")
    with torch.no_grad():
        for layer in drafter.layers[own:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def train_drafter(o: Options) -> dict[str, Any]:
    t0 = time.monotonic()
    model_dir = Path(o.model).expanduser() if o.model else BUILTIN
    target = ModelConfig.from_dir(model_dir)
    out = Path(o.out)
    run = out / "run"
    if o.restart and run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True, exist_ok=True)
    settings = run / "settings.json"
    tok = Tokenizer.from_dir(model_dir)
    cfg_json, cfg, init_cfg = _drafter_config(o, target, tok)
    fingerprint = _check_resume(settings, o, model_dir, cfg.first_draft)
    log = Log(run / "train.log")
    everything = prompts.read_prompts([Path(d) for d in o.data], tok, window=o.window, stride=o.gen_tokens,
                                      vocab=target.vocab_size)
    usable = [p for p in everything if len(p.ids) <= o.max_prompt_tokens]
    if not usable:
        raise InputError("--data", f"every prompt is longer than --max-prompt-tokens {o.max_prompt_tokens}")
    if o.max_prompts:
        usable = usable[: o.max_prompts]
    train_prompts, held = prompts.split(usable, o.held_out, o.seed)
    settings.write_text(json.dumps(fingerprint, indent=2) + "\n")  # the inputs are good: a rerun must match them
    log(f"{len(train_prompts)} training prompts, {len(held)} held out, {len(everything) - len(usable)} too long or "
        f"over --max-prompts, from {', '.join(o.data)}")

    overrides = _engine_overrides(o, model_dir, max(len(p.ids) for p in usable) + max(o.gen_tokens, o.eval_tokens))
    # A request resumes a retained state only when its prompt extends another prompt and the completion the target
    # wrote for it, which training prompts practically never do: copying every finished lane's state to the host when
    # the next prompt takes the lane would cost host time each round and up to engine.retained_host_memory of pinned
    # memory, for nothing.
    engine = Engine(load_config(profile=o.profile, overrides={"engine.retained_host_memory": 0, **overrides,
                                                              "spec.backend": "off"}))
    device, model = engine.runner.device, engine.model
    budget_s = o.time_budget
    reserve = max(20.0, 0.05 * budget_s) if budget_s else 0.0
    gen_deadline = generation_deadline(t0, time.monotonic(), budget_s, o.gen_share)
    data = generate.generate(engine, train_prompts, o.gen_tokens, o.seed, run / "data", gen_deadline)
    del engine  # its lane caches and graphs; the model stays for the taps
    _free(device)
    if len(data) == 0:
        raise InputError("--time-budget", "no completion finished within the generation share of the budget")
    log(f"data: {len(data)} sequences, {data.completion_tokens} completion tokens")

    dtype = next(model.parameters()).dtype
    features, tap_s = tap_features(model, cfg.target_layer_ids, data, device, dtype, o.tap_cache, log,
                                   last=o.distill > 0 or o.distill_tv > 0)
    torch.manual_seed(o.seed)
    drafter = DrafterModel(cfg).to(device)
    if o.init:
        assert init_cfg is not None
        start = load_drafter(Path(o.init), init_cfg, device=device, dtype=torch.float32)
        load_grown(drafter, start)
        del start
    embed = model.embed_tokens.weight
    head = embed if model.lm_head is None else dense(model.lm_head.weight, embed.dtype)  # a 4-bit head dequantized
    params = sum(p.numel() for p in drafter.parameters())
    log(f"drafter: {cfg.num_layers} layers, taps {list(cfg.target_layer_ids)}, {params / 1e6:.2f}M parameters")
    if o.distill or o.distill_tv:
        final = target.num_hidden_layers - 1
        also = "" if final in cfg.target_layer_ids else ", tapped for it alone"
        tv = f", total variation {o.distill_tv}" if o.distill_tv else ""
        tv += f" under top-k {o.tv_cut[0]} and top-p {o.tv_cut[1]}" if o.tv_cut else ""
        log(f"distill: weight {o.distill}{tv}, the teacher reads the target's last layer ({final}{also})")
    loop = Loop(drafter, embed, head, features, data, list(range(len(data))),
                Recipe(o.batch, o.anchors, o.lr, o.warmup, recipe.gamma_for(o.block_size), o.seed, o.distill,
                       o.distill_tv, o.tv_cut), device,
                final_norm=model.norm)
    checkpoint = run / "checkpoint.pt"
    if checkpoint.is_file():
        loop.load(checkpoint)
        log(f"resumed at step {loop.counters.step} ({loop.counters.tokens} tokens, {loop.counters.seconds:.0f} s)")
    loop.micro = memory.fit_micro_batch(loop.probe, o.batch, loop.optimizer_bytes(), device)
    if loop.micro < o.batch:
        log(f"memory: {loop.micro} sequences per micro-batch, {-(-o.batch // loop.micro)} per step")
    # The time budget covers the whole run: what the first run to reach training spent before it (generation, taps)
    # is kept, so a resumed run trains for what is left rather than starting the clock again.
    before = run / "before_training_s"
    if not before.is_file():
        before.write_text(f"{time.monotonic() - t0:.1f}")
    train_s = max(1.0, budget_s - float(before.read_text()) - reserve) if budget_s else 0.0
    loop.run(Budget(o.steps, o.train_tokens, train_s), checkpoint, o.checkpoint_every, log)

    save_drafter(out, cfg_json, drafter, torch.bfloat16)
    if o.shortlist:
        counts = torch.from_numpy(data.counts(target.vocab_size))
        shortlist.build(head, out / SHORTLIST, counts, o.shortlist, exclude=(cfg.mask_token_id,))
    c, last = loop.counters, loop.last
    del loop, drafter, features, model, embed, head
    _free(device)
    result = evaluate(overrides, o.profile, str(out), cfg.width, [list(p.ids) for p in held], o.eval_tokens,
                      o.seed) if held else {}
    summary = {"target": str(model_dir), "data": list(o.data), "sequences": len(data),
               "completion_tokens": data.completion_tokens, "steps": c.step, "train_tokens": c.tokens,
               "train_seconds": round(c.seconds, 1), "tap_seconds": round(tap_s, 1), "params": params,
               "last_loss": round(last.get("loss", float("nan")), 4),
               "last_teacher_forced_tokens_per_round": round(last.get("tau", float("nan")), 3),
               "seconds": round(time.monotonic() - t0, 1), "device": _device_name(device), **result}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log("summary " + json.dumps(summary))
    return summary


def generation_deadline(start: float, ready: float, budget_s: float, share: float) -> float:
    """When generation stops taking new work (time.monotonic()): `share` of the budget the engine's start-up left.

    Start-up (loading, and on a fresh GPU compiling the kernels and capturing the graphs) varies from seconds to
    minutes between machines; a share of the whole budget let a slow start cut the data to a fifth on an H200
    (3,222 of 16,352 sequences in the built-in drafter's run), a share of what is left keeps it. 0: no budget."""
    if not budget_s:
        return float("inf")
    return ready + share * max(0.0, budget_s - (ready - start))


def _mask_id(o: Options, tok: Tokenizer, target: ModelConfig) -> int:
    if o.mask_token_id is not None:
        if not 0 <= o.mask_token_id < target.vocab_size:
            raise InputError("--mask-token-id",
                             f"{o.mask_token_id} is not a row of the {target.vocab_size}-row embedding")
        return o.mask_token_id
    for name in MASK_NAMES:
        found = tok.token_to_id(name)
        if found is not None and found < target.vocab_size:
            return found
    if tok.vocab_size < target.vocab_size:
        return tok.vocab_size  # the first embedding row no token uses, as the DFlash drafters of Qwen3 do
    raise InputError("--mask-token-id", "the tokenizer names no mask token and every embedding row is a token: "
                                        "give the id of a row the prompts never use")


def _engine_overrides(o: Options, model_dir: Path, longest: int) -> dict[str, Any]:
    sets = parse_overrides(list(o.sets))
    overrides: dict[str, Any] = {"model.path": str(model_dir), "log.level": "warning", **sets}
    if "engine.context" not in sets:
        overrides["engine.context"] = max(256, -(-(longest + 16) // 64) * 64)
    if "engine.lanes" not in sets and o.profile is None and torch.cuda.is_available():
        overrides["engine.lanes"] = 64  # generation throughput; the default 4 lanes leave a GPU idle
    return overrides


def _drafter_config(o: Options, target: ModelConfig,
                    tok: Tokenizer) -> tuple[dict[str, Any], DrafterConfig, DrafterConfig | None]:
    """The config.json of the drafter this run trains, that config read, and the --init drafter's own config (None
    without --init)."""
    init_cfg: DrafterConfig | None = None
    if o.init:
        cfg_json = read_config_json(Path(o.init) / "config.json", "--init names a drafter directory")
        init_cfg = cfg = DrafterConfig.from_dict(cfg_json, target)  # refused when it does not fit this target
        if o.grow_layers:
            cfg_json = grown(cfg_json, o.grow_layers)
            cfg = DrafterConfig.from_dict(cfg_json, target)
    else:
        cfg_json = drafter_config_json(
            target, num_layers=o.layers, intermediate_size=o.intermediate_size or None, block_size=o.block_size,
            sliding_window=o.sliding_window, mask_token_id=_mask_id(o, tok, target), selector_rank=o.selector_rank,
            selector_top_k=o.selector_top_k,
            target_layer_ids=list(o.taps) or spread_layer_ids(target.num_hidden_layers, 5))
        try:
            cfg = DrafterConfig.from_dict(cfg_json, target)
        except ArtifactError as e:  # a shape the flags asked for that this target cannot carry
            raise InputError("--taps" if "target_layer_ids" in str(e) else "drafter", str(e)) from e
    # who drafts slot 1: as the flag says, else as the --init drafter does (so fine-tuning keeps its form)
    form = cfg.first_draft if o.first_draft is None else FIRST_DRAFT_FORMS[o.first_draft]
    if form != cfg.first_draft:
        cfg_json = {**cfg_json, "dflash_config": {**cfg_json.get("dflash_config", {}), "first_draft": form}}
        try:
            cfg = DrafterConfig.from_dict(cfg_json, target)
        except ArtifactError as e:
            raise InputError("--first-draft", str(e)) from e
    return cfg_json, cfg, init_cfg


def _check_resume(path: Path, o: Options, model_dir: Path, first_draft: str) -> dict[str, Any]:
    """The run's settings (with the drafter's form as resolved: `first_draft`); refused when DIR/run already holds
    a run with other ones."""
    want = {**o.fingerprint(), "first_draft": first_draft, "model": str(model_dir.resolve()),
            "model_config": json.loads((model_dir / "config.json").read_text())}
    if not path.is_file():
        return want
    # runs from before --distill trained on hard labels, those from before --distill-tv without it, and those from
    # before --first-draft drafted slot 1 themselves
    have = {"distill": 0.0, "distill_tv": 0.0, "tv_cut": None, "first_draft": "", **json.loads(path.read_text())}
    diff = [f"{k} {have.get(k)!r} (now {v!r})" for k, v in want.items() if have.get(k) != v and k != "model_config"]
    if have.get("model_config") != want["model_config"]:
        diff.append("the model's config.json")
    if diff:
        raise InputError("--out", f"{path.parent} holds a run with other settings: {'; '.join(diff)}. Run with the "
                                  "same settings to continue it, --restart to discard it, or another --out")
    return want


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
