"""Train the built-in target and its MTP head on the Python files of the machine it runs on, within a time budget.

Owns: the training run (data on device, AdamW, warmup + cosine schedule fitted to the time budget or set by
--max-steps, periodic checkpoints, held-out evaluation, the log). Does not own: the model's shape and MTP math
(model.py), the corpus (corpus.py, data.py), prompts (prompts.py), the file format (export.py) or what a run spread
over several jobs keeps on disk (resume.py).

Run from the repository root (one GPU; the README beside this file has the full command):
    python -m tools.artifact.train_target --out OUT --time-budget 500
A CPU smoke run of the same code path: python -m tools.artifact.train_target --toy --out /some/dir

A run longer than one job: give the whole run's --max-steps and each job's --time-budget; when the budget
(or Ctrl-C) stops it short, OUT/state.pt holds everything, and the same command continues from there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import TextIO

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import Qwen3_5ForCausalLM

from tools.artifact import corpus, data, export, gdn_kernel, prompts, resume, unloop
from tools.artifact.model import TARGET_SHAPE, TOY_SHAPE, MTPHead, losses, target_config

MTP_WEIGHT = 0.3  # DeepSeek-V3's early-training weight; the MTP head is auxiliary, the target's loss comes first.
WARMUP_STEPS = 150
FINAL_LR_SHARE = 0.1
SAVE_EVERY_S = 120.0
RESERVE_S = 25.0  # final evaluation and export after the last step


class Log:
    """Lines to stdout and to OUT/train.log; the last line of a run is a JSON summary."""

    def __init__(self, path: Path, append: bool = False) -> None:
        self.t0 = time.monotonic()
        self.file: TextIO = path.open("a" if append else "w", buffering=1)

    def __call__(self, message: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] {message}"
        print(line, flush=True)
        self.file.write(line + "\n")


class Batches:
    """Non-overlapping windows of seq_len+1 tokens, visited in a fresh random order each epoch, kept on device."""

    def __init__(self, stream: np.ndarray, window: int, batch: int, seed: int, device: torch.device) -> None:
        count = stream.size // window
        if count < batch:
            raise ValueError(f"corpus has {count} windows of {window} tokens, fewer than one batch of {batch}")
        self.windows = torch.from_numpy(stream[: count * window].astype(np.int64)).view(count, window).to(device)
        self.batch = batch
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.order = torch.randperm(count, generator=self.gen)
        self.pos = 0
        self.epochs = 0

    def state_dict(self) -> dict[str, object]:
        return {"gen": self.gen.get_state(), "order": self.order, "pos": self.pos, "epochs": self.epochs}

    def load_state_dict(self, state: dict) -> None:  # type: ignore[type-arg]
        self.gen.set_state(state["gen"])
        self.order, self.pos, self.epochs = state["order"], state["pos"], state["epochs"]

    def next(self) -> torch.Tensor:  # [batch, seq_len+1] int64, device
        if self.pos + self.batch > self.order.numel():
            self.order = torch.randperm(self.order.numel(), generator=self.gen)
            self.pos = 0
            self.epochs += 1
        idx = self.order[self.pos : self.pos + self.batch].to(self.windows.device)
        self.pos += self.batch
        return self.windows[idx]


def lr_at(step: int, total: int, peak: float, warmup: int = WARMUP_STEPS) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (FINAL_LR_SHARE + (1 - FINAL_LR_SHARE) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(net: Qwen3_5ForCausalLM, mtp: MTPHead, held: Batches, batches: int, newline: np.ndarray,
             lam: float) -> dict[str, float]:
    """Held-out losses and accuracies, and on the same windows made repetitive (`unloop.repeated`, a fixed seed):
    the repetition penalty and the mean probability of a repeated line's later copies (`repeat_p`)."""
    net.eval()
    mtp.eval()
    sums: dict[str, float] = {}
    gen = np.random.default_rng(0)
    for i in range(batches):
        seq = held.windows[i * held.batch : (i + 1) * held.batch]
        with torch.autocast(seq.device.type, dtype=torch.bfloat16):
            out = losses(net, mtp, seq)
            rep_seq, start, length = unloop.repeated(seq, newline, gen)
            rep = unloop.repetition_losses(unloop.forward_logits(net, rep_seq), rep_seq, start, length, lam)
        out = {**out, "unloop": rep["unloop"], "repeat_p": rep["repeat_p"]}
        for k, v in out.items():
            sums[k] = sums.get(k, 0.0) + float(v) / batches
    net.train()
    mtp.train()
    return sums


def fitting_batch(
    net: Qwen3_5ForCausalLM, mtp: MTPHead, stream: np.ndarray, window: int, batch: int, device: torch.device,
    log: Log,
) -> int:
    """The largest batch, halving from the asked one, whose forward and backward fit in device memory."""
    while True:
        seq = torch.from_numpy(stream[: batch * window].astype(np.int64)).view(batch, window).to(device)
        try:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = losses(net, mtp, seq)
            (out["loss"] + MTP_WEIGHT * out["mtp_loss"]).backward()
        except torch.OutOfMemoryError:
            if batch <= 8:
                raise
            log(f"batch {batch} does not fit; trying {batch // 2}")
            batch //= 2
            continue
        finally:
            net.zero_grad(set_to_none=True)
            mtp.zero_grad(set_to_none=True)
        if device.type == "cuda":
            log(f"batch {batch} fits: peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
            torch.cuda.empty_cache()
        return batch


def load_weights(net: Qwen3_5ForCausalLM, mtp: MTPHead, path: Path, log: Log) -> None:
    """The target's and MTP head's weights from a checkpoint in the layout export.py writes (a tied head absent)."""
    from safetensors.torch import load_file

    found: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        found.update(load_file(shard))
    head = {k[len("mtp."):]: v for k, v in found.items() if k.startswith("mtp.")}
    body = {k: v for k, v in found.items() if not k.startswith("mtp.")}
    try:
        missing, unexpected = net.load_state_dict(body, strict=False)
        mtp.load_state_dict(head)
    except RuntimeError as e:  # a tensor of another shape
        raise SystemExit(f"{path} does not hold this model's weights: {e}") from e
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"{path} does not hold this model's weights: missing {missing}, unexpected {unexpected}")
    net.tie_weights()
    log(f"weights from {path}: {len(found)} tensors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, default=Path("ignis/builtin/tokenizer.json"))
    parser.add_argument("--time-budget", type=float, default=500.0, help="seconds, from start to files written")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-train-mb", type=float, default=250.0, help="cap on training text (bounds prep time)")
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time decides)")
    parser.add_argument("--toy", action="store_true", help="tiny shape, stdlib only, a few files: a CPU smoke run")
    parser.add_argument("--warmup", type=int, default=WARMUP_STEPS, help="steps of linear warmup")
    parser.add_argument("--init", type=Path, default=None,
                        help="start from this checkpoint's weights (a run's --out or the installed artifact)")
    parser.add_argument("--unloop", type=float, default=0.0,
                        help="share of each batch's rows made repetitive and trained against repeating (unloop.py)")
    parser.add_argument("--unloop-lambda", type=float, default=0.5,
                        help="a repeated line's token is asked to be this times as likely as in the copy before")
    args = parser.parse_args()
    if not 0.0 <= args.unloop < 1.0:
        parser.error(f"--unloop is a share of each batch's rows, at least 0 and below 1; got {args.unloop}")

    t0 = time.monotonic()
    deadline = t0 + args.time_budget
    args.out.mkdir(parents=True, exist_ok=True)
    want = resume.settings(args)
    state_path = args.out / resume.STATE
    state = resume.load_state(state_path) if state_path.is_file() else None
    if state is not None and (state["done"] or not state["settings"]["max_steps"]):
        state = None  # a finished run, or one fitted to a single budget: this one starts over
    if state is not None:
        if not args.max_steps:
            parser.error(f"{state_path} holds a run to continue: give its --max-steps ({state['total']})")
        resume.check(state["settings"], want, str(state_path))
    log = Log(args.out / "train.log", append=state is not None)
    log(f"torch {torch.__version__}; args {vars(args)}")
    if state is not None:
        log(f"continuing at step {state['step']} of {state['total']}")

    # Data first: its worker processes are forked before CUDA is touched.
    tok = Tokenizer.from_file(str(args.tokenizer))
    streams = args.out / resume.STREAMS
    cached = resume.load_streams(streams, resume.data_settings(want))
    if cached is not None:
        train_stream, held_stream, counts = cached
        train_counts, held_counts = counts["train"], counts["held_out"]
        log(f"tokens from {streams}")
    else:
        train_files, held_files = corpus.load(corpus.default_roots(site_packages=not args.toy))
        if args.toy:
            train_files, held_files = train_files[:60], held_files[:20]
        train_files = corpus.capped(train_files, int(args.max_train_mb * 1e6))
        log(f"files: train {len(train_files)}, held-out {len(held_files)}; "
            f"train MB {sum(len(f.text) for f in train_files) / 1e6:.1f}")
        prompts.write_jsonl(args.out / "heldout_prompts.jsonl", prompts.code_prompts(held_files, 64))
        prompts.write_jsonl(args.out / "heldout_chat.jsonl", prompts.chat_prompts(held_files, 16))
        workers = min(16, os.cpu_count() or 1)
        train_stream, train_counts = data.build_stream(tok, train_files, with_chat=True, seed=args.seed,
                                                       workers=workers)
        held_stream, held_counts = data.build_stream(tok, held_files, with_chat=False, seed=args.seed, workers=1)
        resume.save_streams(streams, train_stream, held_stream, {"train": train_counts, "held_out": held_counts},
                            resume.data_settings(want))
    log(f"train {train_counts}; held-out {held_counts}")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    shape = TOY_SHAPE if args.toy else TARGET_SHAPE
    gdn = gdn_kernel.choose(device, shape["linear_num_value_heads"], shape["linear_key_head_dim"],
                            shape["linear_value_head_dim"], log)
    log(f"device {device}; Gated DeltaNet kernel: {gdn}")

    torch.manual_seed(args.seed)
    config = target_config(tok.get_vocab_size(), shape)
    config._attn_implementation = "sdpa"
    with device:
        net = Qwen3_5ForCausalLM(config)
        mtp = MTPHead(net.config)
    params = [p for p in list(net.parameters()) + list(mtp.parameters()) if p.requires_grad]
    n_target = sum(p.numel() for p in net.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    log(f"parameters: target {n_target / 1e6:.2f}M, mtp {n_mtp / 1e6:.2f}M, "
        f"bf16 {(n_target + n_mtp) * 2 / 2**20:.1f} MiB")
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda",
    )
    window = args.seq_len + 1
    if state is None:
        args.batch = fitting_batch(net, mtp, train_stream, window, args.batch, device, log)
    else:
        args.batch = state["batch"]  # the one the first job fitted
    train = Batches(train_stream, window, args.batch, args.seed, device)
    held = Batches(held_stream, window, args.batch, args.seed, device)
    eval_batches = min(2, held.windows.shape[0] // args.batch)

    total = args.max_steps or 10**9  # refined from the measured step time once warm
    step, tokens, before, timed_from = 0, 0, 0.0, None
    newline = unloop.newline_ids(tok)
    rep_rows = round(args.batch * args.unloop)
    rep_share = rep_rows / args.batch
    rep_gen = np.random.default_rng(args.seed)
    if rep_rows:
        log(f"unloop: {rep_rows} of {args.batch} rows a step repeat a line, lambda {args.unloop_lambda}")
    if state is None and args.init is not None:
        load_weights(net, mtp, args.init, log)
    if state is not None:
        rep_gen.bit_generator.state = state["unloop_gen"]
        net.load_state_dict(state["net"])
        mtp.load_state_dict(state["mtp"])
        opt.load_state_dict(state["opt"])
        train.load_state_dict(state["train"])
        step, tokens, before = state["step"], state["tokens"], state["seconds"]

    def save(tag: str, done: bool = False) -> None:
        export.save_shards(export.checkpoint_tensors(net, mtp, config.tie_word_embeddings), args.out)
        export.save_config(config, args.out)
        resume.save_state(state_path, {
            "settings": want, "net": net.state_dict(), "mtp": mtp.state_dict(), "opt": opt.state_dict(),
            "train": train.state_dict(), "unloop_gen": rep_gen.bit_generator.state, "batch": args.batch,
            "step": step, "tokens": tokens, "total": total, "seconds": before + time.monotonic() - t0, "done": done})
        log(f"saved {tag}")

    # Ctrl-C ends the run at the next step's end, with everything saved; a second one stops it at once.
    interrupted = threading.Event()

    def on_sigint(signum: int, frame: object) -> None:
        interrupted.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = signal.signal(signal.SIGINT, on_sigint)
    last_save = time.monotonic()
    while step < total:
        if step == 10:
            if device.type == "cuda":
                torch.cuda.synchronize()
            timed_from = time.monotonic()
        if step == 40 and not args.max_steps and timed_from is not None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.monotonic() - timed_from) / 30
            total = 40 + int((deadline - RESERVE_S - time.monotonic()) / per_step)
            log(f"{per_step * 1000:.0f} ms/step, {args.batch * args.seq_len / per_step / 1e3:.0f}k tok/s: "
                f"{total} steps fit the budget")
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args.lr, args.warmup)
        seq = train.next()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = losses(net, mtp, seq[rep_rows:])
            loss = out["loss"] + MTP_WEIGHT * out["mtp_loss"]
            if rep_rows:
                rep_seq, start, length = unloop.repeated(seq[:rep_rows], newline, rep_gen)
                rep = unloop.repetition_losses(unloop.forward_logits(net, rep_seq), rep_seq, start, length,
                                               args.unloop_lambda)
                loss = (1 - rep_share) * loss + rep_share * (rep["loss"] + rep["unloop"])
                out = {**out, "unloop": rep["unloop"], "repeat_p": rep["repeat_p"]}
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        tokens += seq.shape[0] * args.seq_len
        if step % 50 == 0 or step <= 3:
            seen = {k: v.item() for k, v in out.items()}
            log(f"step {step}/{total if total < 10**9 else '?'} loss {seen['loss']:.4f} "
                f"mtp {seen['mtp_loss']:.4f} acc {seen['acc']:.3f} mtp_acc {seen['mtp_acc']:.3f} "
                f"gnorm {float(grad_norm):.2f} lr {lr_at(step, total, args.lr, args.warmup):.2e} "
                f"tokens {tokens / 1e6:.1f}M"
                + (f" unloop {seen['unloop']:.4f} repeat_p {seen['repeat_p']:.3f}" if rep_rows else ""))
        if time.monotonic() - last_save > SAVE_EVERY_S:
            save(f"checkpoint at step {step}")
            last_save = time.monotonic()
        if time.monotonic() > deadline - RESERVE_S:
            log(f"time budget reached at step {step}")
            break
        if interrupted.is_set():
            log(f"interrupted at step {step}")
            break
    signal.signal(signal.SIGINT, previous)

    if args.max_steps and step < total:
        save(f"at step {step} of {total}: the same command continues the run")
        return
    result = evaluate(net, mtp, held, eval_batches, newline, args.unloop_lambda) if eval_batches else {}
    save(f"final at step {step}", done=True)
    summary = {
        "steps": step, "tokens": tokens, "epochs": train.epochs + train.pos / train.order.numel(),
        "seq_len": args.seq_len, "batch": args.batch, "gdn_kernel": gdn, "lr": args.lr, "mtp_weight": MTP_WEIGHT,
        "train_seconds": before + time.monotonic() - t0, "device": torch.cuda.get_device_name() if device.type == "cuda"
        else "cpu", "params_target": n_target, "params_mtp": n_mtp, "train": train_counts, "held_out": held_counts,
        "held_out_eval_tokens": eval_batches * args.batch * args.seq_len,
        **{f"held_out_{k}": v for k, v in result.items()},
    }
    log("summary " + json.dumps(summary))


if __name__ == "__main__":
    main()
