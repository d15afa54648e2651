"""The `ignis` command: `config show`, `generate`, `serve` and `train-drafter`.

Owns: argument parsing, turning flags into config overrides, and the exit codes (0 done, 2 bad config, input or
artifact with one line on stderr and no traceback, 1 any other ignis error). Does not own: config rules
(ignis.config), generation (ignis.client.llm), the server (ignis.server.serve, imported only by `serve`) or drafter
training (ignis.train).
Nothing heavy is imported until a command needs it, so `ignis config show` answers at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from ignis.errors import ArtifactError, ConfigError, IgnisError, InputError


def _add_config_flags(p: argparse.ArgumentParser, *, config_file: bool = True) -> None:
    p.add_argument("--profile", help="built-in profile: cpu, h200, rtx5090, rtxpro6000, rtx50-16gb")
    if config_file:
        p.add_argument("--config", metavar="FILE", help="TOML file applied over the profile")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key, e.g. --set spec.backend=mtp (repeatable; applied last)")


def build_parser() -> argparse.ArgumentParser:
    from ignis import __version__

    parser = argparse.ArgumentParser(prog="ignis", description="Speculative decoding for Qwen3.5-family models.")
    parser.add_argument("--version", action="version", version=f"ignis {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    config = commands.add_parser("config", help="inspect the configuration")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser("show", help="print the resolved config as TOML")
    _add_config_flags(show)

    gen = commands.add_parser("generate", help="generate one completion and print it")
    gen.add_argument("--model", metavar="PATH", help="artifact directory (default: the built-in model)")
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user turn through the chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: the engine seed)")
    _add_config_flags(gen)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("--model", metavar="PATH", help="artifact directory (default: the built-in model)")
    serve.add_argument("--host", help="address to listen on (server.host)")
    serve.add_argument("--port", type=int, help="port to listen on (server.port)")
    _add_config_flags(serve)

    from ignis.train.options import add_arguments

    train = commands.add_parser("train-drafter", help="train a dflash2 drafter for a Qwen3.5 checkpoint")
    add_arguments(train)
    _add_config_flags(train, config_file=False)
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
        return _serve(args)
    except (ConfigError, InputError, ArtifactError) as e:
        print(f"ignis: error: {e}", file=sys.stderr)
        return 2
    except IgnisError as e:
        print(f"ignis: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _config_show(args: argparse.Namespace) -> int:
    from ignis.config import load_config

    cfg = load_config(profile=args.profile, path=args.config, overrides=args.sets)
    print(cfg.to_toml(), end="")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from ignis.config import parse_overrides
    from ignis.params import SamplingParams

    # Everything a user can get wrong is checked before the model loads.
    overrides = parse_overrides(args.sets)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    from ignis.client.llm import LLM

    llm = LLM(args.model, profile=args.profile, config=args.config, overrides=overrides)
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


def _serve(args: argparse.Namespace) -> int:
    from ignis.config import load_config
    from ignis.logging import configure, log_resolved

    # The flags are shorthands for --set and win over it, as the more specific spelling.
    sets = list(args.sets)
    for key, value in (("model.path", args.model), ("server.host", args.host), ("server.port", args.port)):
        if value is not None:
            sets.append(f"{key}={value}")
    cfg = load_config(profile=args.profile, path=args.config, overrides=sets)
    configure(cfg.log.level, cfg.log.format)
    log_resolved(cfg)
    from ignis.server.serve import main as serve_main

    serve_main(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
