"""The `ignis` command: `serve [MODEL]`, `generate [MODEL]`, `bench`, `train-drafter`, `quantize`, `config show`.

Owns: argument parsing, the first-class flags and the config keys they stand for, the order of the layers
(defaults < profile < --config file < IGNIS_* environment < --set < flags), checking the model (a directory or a
Hugging Face id, fetched here) before any process starts, and the exit codes (0 done, 2 bad config, input or
artifact, 1 any other error; each one line on stderr, the traceback only with --debug or IGNIS_DEBUG=1). Does not
own: config rules (ignis.config), hub downloads (ignis.hub), generation (ignis.client.llm), the server
(ignis.server.serve), the benchmark (ignis.bench) or drafter training (ignis.train). Nothing heavy is imported
until a command needs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ignis.config import IgnisConfig, load_config, parse_overrides
from ignis.config.schema import SECTIONS
from ignis.errors import ArtifactError, ConfigError, IgnisError, InputError

# flag dest -> config key. The flags are shorthands for --set and win over it, as the more specific spelling.
FLAG_KEYS = {
    "lanes": "engine.lanes", "context": "engine.context", "drafter": "spec.drafter",
    "host": "server.host", "port": "server.port", "frontends": "server.frontends", "api_key": "server.api_key",
}


def _default(dotted: str) -> Any:
    section, key = dotted.split(".")
    return {f.name: f.default for f in dataclasses.fields(SECTIONS[section])}[key]


def _add_config_flags(p: argparse.ArgumentParser, *, config_file: bool = True) -> None:
    p.add_argument("--profile", default=os.environ.get("IGNIS_PROFILE"),
                   help="built-in profile: cpu, h200, rtx5090, rtxpro6000, rtx50-16gb (default: $IGNIS_PROFILE, or "
                        "none: the built-in defaults)")
    if config_file:
        p.add_argument("--config", metavar="FILE", default=os.environ.get("IGNIS_CONFIG"),
                       help="TOML file applied over the profile (default: $IGNIS_CONFIG, or none)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key, e.g. --set engine.max_rows=1024 (repeatable; over IGNIS_* variables)")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="checkpoint directory or Hugging Face id, e.g. Qwen/Qwen3.5-27B (default: the built-in model)")
    p.add_argument("-m", "--model", dest="model_flag", metavar="MODEL", help="the same as MODEL")
    p.add_argument("--revision", help="hub branch, tag or commit for a Hugging Face id (default: main)")
    p.add_argument("--lanes", type=int, metavar="N",
                   help=f"sequences decoded at once (engine.lanes; default {_default('engine.lanes')}, or the "
                        f"profile's)")
    p.add_argument("--context", type=int, metavar="N",
                   help="positions per lane, prompt + output (engine.context; default: the model's "
                        "max_position_embeddings, fitted to the memory left)")
    p.add_argument("--spec", metavar="BACKEND[:K]",
                   help="speculation: off, mtp[:K], dflash2:K, auto (spec.backend and spec.draft_tokens; default "
                        "auto: dflash2 at 7 when the model carries a drafter, off when it does not)")
    p.add_argument("--drafter", metavar="PATH", help="drafter directory (spec.drafter; default MODEL/drafter)")


def build_parser() -> argparse.ArgumentParser:
    from ignis import __version__

    parser = argparse.ArgumentParser(prog="ignis", description="Speculative decoding for Qwen3.5-family models.")
    parser.add_argument("--version", action="version", version=f"ignis {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    config = commands.add_parser("config", help="inspect the configuration")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser("show", help="print the resolved config as TOML")
    show.add_argument("--model", metavar="PATH",
                      help="also print the memory plan of this model directory (only its config.json files are read)")
    _add_config_flags(show)

    gen = commands.add_parser("generate", help="generate one completion and print it")
    _add_model_flags(gen)
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user turn through the chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: the engine seed)")
    _add_config_flags(gen)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    _add_model_flags(serve)
    serve.add_argument("--host", help=f"address to listen on (server.host; default {_default('server.host')})")
    serve.add_argument("--port", type=int, help=f"port to listen on (server.port; default {_default('server.port')})")
    serve.add_argument("--frontends", type=int, metavar="N",
                       help=f"front-end processes sharing the port (server.frontends; default "
                            f"{_default('server.frontends')})")
    serve.add_argument("--api-key", metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every route but /health (server.api_key; default "
                            "none). A command line is visible to other users of the machine: prefer "
                            "$IGNIS_SERVER_API_KEY or server.api_key_file")
    _add_config_flags(serve)

    from ignis.train.options import add_arguments

    train = commands.add_parser("train-drafter", help="train a dflash2 drafter for a Qwen3.5 checkpoint")
    add_arguments(train)
    _add_config_flags(train, config_file=False)

    from ignis.bench.cli import add_parser as add_bench

    add_bench(commands)

    quant = commands.add_parser("quantize", help="convert a checkpoint to 4-bit weights (docs/quantization.md)")
    quant.add_argument("src", metavar="SRC", help="Hugging Face Qwen3.5 checkpoint directory")
    quant.add_argument("dst", metavar="DST", help="new (or empty) directory for the quantized checkpoint")
    quant.add_argument("--bits", type=int, default=4, choices=[4], help="bits a weight (4)")
    quant.add_argument("--group", type=int, default=128, choices=[64, 128],
                       help="input columns sharing one scale and zero point (default 128)")
    quant.add_argument("--head", action="store_true",
                       help="quantize the output head (lm_head) too: a decode reads it whole every round (2.5 GB of "
                            "bf16 at the 27B shape, 0.6 GB in 4 bits), at some cost in perplexity "
                            "(docs/quantization.md)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "config":
            return _config_show(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "train-drafter":
            return _train_drafter(args)
        if args.command == "bench":
            from ignis.bench.cli import run as bench

            return bench(args)
        if args.command == "quantize":
            return _quantize(args)
        return _serve(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if getattr(args, "debug", False) or os.environ.get("IGNIS_DEBUG", "") not in ("", "0"):
            raise
        print(f"ignis: error: {_one_line(e)}", file=sys.stderr)
        return 2 if isinstance(e, (ConfigError, InputError, ArtifactError)) else 1


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if isinstance(e, IgnisError):
        return text
    return f"{type(e).__name__}: {text} (run with --debug for the traceback)"


def resolve(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> IgnisConfig:
    """The config a command runs with: every layer, then MODEL resolved to a local directory (a hub id downloaded,
    and served under its id) and checked, so a bad model is refused before anything starts."""
    from ignis.artifact import resolve_model_path
    from ignis.hub import resolve as resolve_model
    from ignis.model.config import ModelConfig

    env = os.environ if environ is None else environ
    sets = [*args.sets, *(f"{dotted}={value}" for dotted, value in flag_overrides(args).items())]
    cfg = load_config(profile=args.profile, path=args.config, overrides=sets, env=env)
    if cfg.model.path:
        path, name = resolve_model(cfg.model.path, args.revision)
        model = dataclasses.replace(cfg.model, path=str(path), name=cfg.model.name or name or "")
        cfg = dataclasses.replace(cfg, model=model)
    elif args.revision is not None:
        raise ArtifactError("--revision applies to a Hugging Face id; give MODEL too")
    ModelConfig.from_dir(resolve_model_path(cfg))
    return cfg


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The first-class flags that were given, as dotted config keys."""
    out: dict[str, Any] = {}
    if args.model is not None and args.model_flag is not None:
        raise InputError("MODEL", "give the model once: as MODEL or as --model")
    model = args.model if args.model is not None else args.model_flag
    if model is not None:
        out["model.path"] = model
    for dest, dotted in FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None:
            out[dotted] = value
    if args.spec is not None:
        out.update(parse_spec(args.spec))
    return out


def parse_spec(text: str) -> dict[str, Any]:
    """--spec BACKEND[:K] -> spec.backend (and spec.draft_tokens when K is given, or 0 for off and auto)."""
    name, sep, k = text.partition(":")
    out: dict[str, Any] = {"spec.backend": name}
    if sep:
        if not k.isdigit():
            raise ConfigError("--spec", f'got "{text}"; expected BACKEND or BACKEND:K with K a number of drafts, '
                              "e.g. dflash2:7")
        out["spec.draft_tokens"] = int(k)
    elif name in ("off", "auto"):
        out["spec.draft_tokens"] = 0
    return out


def _config_show(args: argparse.Namespace) -> int:
    sets = [*args.sets, *([f"model.path={args.model}"] if args.model else [])]
    cfg = load_config(profile=args.profile, path=args.config, overrides=sets, env=os.environ)
    print(cfg.to_toml(), end="")
    if args.model:
        from pathlib import Path

        from ignis.plan import memory_plan, weights_note

        plan = memory_plan(cfg, Path(args.model))
        print(plan.render() + weights_note(cfg, plan), end="")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from ignis.params import SamplingParams

    # Everything a user can get wrong is checked before the model loads.
    parse_overrides(args.sets)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    cfg = resolve(args)
    from ignis.client.llm import LLM

    overrides = {f"{section}.{key}": value for section, table in cfg.as_dict().items() for key, value in table.items()}
    llm = LLM(cfg.model.path or None, overrides=overrides)
    try:
        if args.chat:
            outs = llm.chat([{"role": "user", "content": args.prompt}], params)
        else:
            outs = llm.generate([args.prompt], params)
    finally:
        llm.close()
    out = outs[0]
    print(out.outputs[0].text)
    print(_metrics_line(out.metrics, out.outputs[0].finish_reason), file=sys.stderr)
    return 0


def _metrics_line(metrics: dict[str, Any], finish_reason: str | None) -> str:
    keys = ("prompt_tokens", "prompt_ms", "decode_tokens", "decode_ms", "tokens_per_s", "rounds", "drafted", "accepted")
    parts = [f"{k}={metrics[k]:.1f}" if isinstance(metrics.get(k), float) else f"{k}={metrics.get(k, 0)}" for k in keys]
    return " ".join([*parts, f"finish_reason={finish_reason}"])


def _train_drafter(args: argparse.Namespace) -> int:
    from ignis.train.options import from_args

    options = from_args(args)  # every flag checked before the model loads
    from ignis.logging import configure
    from ignis.train.run import train_drafter

    configure("warning")  # the run reports its own progress; the engines it builds stay quiet

    try:
        train_drafter(options)
    except KeyboardInterrupt:
        print("ignis: interrupted; run the same command to continue where it stopped", file=sys.stderr)
        return 130
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from ignis.quant.convert import ProgressBar, convert

    convert(args.src, args.dst, group=args.group, bits=args.bits, head=args.head, progress=ProgressBar())
    print(f"wrote {args.dst} (int4, group {args.group}{', output head too' if args.head else ''})", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from ignis.logging import configure, log_resolved

    cfg = resolve(args)
    from ignis.plan import check_plan, on_cuda

    if on_cuda(cfg):  # a plan that cannot fit the GPU is refused before anything loads
        from ignis.artifact import resolve_model_path

        check_plan(cfg, resolve_model_path(cfg))
    configure(cfg.log.level, cfg.log.format)
    log_resolved(cfg)
    from ignis.server.serve import main as serve_main

    serve_main(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
