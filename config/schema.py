"""The config schema: one frozen dataclass per TOML table, and `IgnisConfig` holding all five.

Owns: every key, its default and what it accepts, the rules that tie keys together (speculation needs a backend,
dflash2 needs a draft count, a round must hold every lane's verify columns), and the TOML/dict forms of a
resolved config. Does not own: reading files, profiles or overrides (ignis.config.load), or what the engine
does with a value ("auto" device, dtype and exact are resolved where torch is, in ignis.artifact).

Every section checks itself on construction, so an `IgnisConfig` that exists is a valid one.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ignis.config.fields import check_section, choice, flag, integer, number, text
from ignis.errors import ConfigError

MAX_DRAFT_TOKENS = 7
MIN_CONTEXT = 16
AUTO = "auto"  # spec.backend: dflash2 when the model carries a drafter (see ignis.engine.defaults), else off
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class ModelSection:
    section: ClassVar[str] = "model"

    path: str = text("")  # "" = the built-in default artifact
    name: str = text("")  # served model name; "" = the artifact directory's name
    dtype: str = choice("auto", "auto", "float32", "bfloat16", "float16")  # auto: float32 on cpu, bfloat16 on cuda
    device: str = text("auto", pattern=lambda s: _DEVICE.fullmatch(s) is not None,
                       allowed='"auto", "cpu", "cuda" or "cuda:N"')
    exact: str = choice("auto", "auto", "on", "off")  # batch-invariant arithmetic; auto: on for cpu
    # The weight format a profile's lanes and context were sized for (int4: a checkpoint made by `ignis quantize`);
    # the memory plan counts the checkpoint as it is and names a mismatch. auto: any. fp8 also acts: the decoder
    # projections of a checkpoint in its own precision are converted to float8 e4m3 (a scale per output channel) as
    # the model loads, and run through torch's scaled matmul on CUDA (Hopper or newer; docs/quantization.md).
    weights: str = choice("auto", "auto", "int4", "bf16", "fp8")
    # dummy: read only config.json and make seeded random weights of its shapes on the device, as vLLM's
    # load_format = "dummy" does: for measuring shapes no checkpoint on disk holds (its outputs mean nothing).
    load_format: str = choice("safetensors", "safetensors", "dummy")

    def __post_init__(self) -> None:
        check_section(self.section, self)


@dataclass(frozen=True)
class EngineSection:
    section: ClassVar[str] = "engine"

    lanes: int = integer(4, 1, 1024)  # sequences decoded at once, each with its own KV and recurrent state
    # positions per lane, prompt + output; 0 = auto: the model's max_position_embeddings, fitted to the memory left
    context: int = integer(0, 0, 1048576, allowed="0 (auto: from the model, fitted to memory) or 16..1048576")
    max_rows: int = integer(512, 64)  # rows per round: verify columns plus prefill rows
    prefill_chunk: int = integer(64, 64, multiple_of=64)  # prefill splits only at multiples of this
    max_waiting: int = integer(256, 0)  # queued requests beyond the lanes; more are refused (503)
    seed: int = integer(0, 0, 2**63 - 1)  # seed for requests that bring none
    cpu_threads: int = integer(1, 0, 1024)  # torch intra-op threads on the CPU (0: torch's default); small models run best on 1
    cuda_graphs: bool = flag(True)  # capture the decode/verify rounds at start-up and replay them (CUDA only)
    # Decode rounds queued on the device before the host reads them, where a round only decodes and no lane needs the
    # host between rounds (logprobs, logits shaped on the host, teacher forcing): from 2, each round after the first
    # takes its inputs from the last one's outputs on the device, so the device does not wait on the host between
    # them; a lane whose request stops early in the chain runs the rest of it for nothing. Device round only. A chained
    # plan is read whole when its rounds end: beside async_scheduling (below) it pays only where rounds cannot follow.
    rounds_per_sync: int = integer(1, 1, 4)
    # Queue a decoding lanes' next round before the host reads the last one, where the chained plans' terms allow it
    # (rounds_per_sync above): the host reads round t, stops and streams its tokens while round t + 1 runs, so the
    # device does not wait on the host between rounds; a lane whose request stops in round t runs round t + 1 for
    # nothing. Device round only.
    async_scheduling: bool = flag(True)
    # Device memory the memory plan must fit, in MiB: 0 = the CUDA device's own total. Profiles state their card's.
    memory_mib: int = integer(0, 0)
    # Bytes for the attention layers' K/V, a pool of 64-position pages the lanes share (one long context, many short
    # ones); 0 = auto: every lane's whole context, or the memory left after the weights and states if that is less.
    kv_memory: int = integer(0, 0)
    # Host memory (bytes; pinned on a GPU) for retained slots moved off their lanes, least recently kept dropped
    # first; 0 = keep retained state only on free lanes.
    retained_host_memory: int = integer(8 * 2**30, 0)

    def __post_init__(self) -> None:
        check_section(self.section, self)
        if 0 < self.context < MIN_CONTEXT:
            raise ConfigError("engine.context", f"got {self.context}; expected 0 (auto: from the model, fitted to "
                              f"memory) or {MIN_CONTEXT}..1048576")
        if self.prefill_chunk > self.max_rows:
            raise ConfigError("engine.prefill_chunk", f"got {self.prefill_chunk}, more than engine.max_rows = "
                              f"{self.max_rows}; a prefill chunk must fit in one round: lower it or raise max_rows")


@dataclass(frozen=True)
class SpecSection:
    section: ClassVar[str] = "spec"

    backend: str = text(AUTO)  # "auto" or a name in the entry-point group ignis.spec_backends
    draft_tokens: int = integer(0, 0, MAX_DRAFT_TOKENS, allowed=f"0 (unset) or 1..{MAX_DRAFT_TOKENS}")
    # The drafts' proposal head: the target's output head as it is ("full"), the 4-bit head of the dflash2 drafter's
    # N most frequent tokens ("shortlist": <drafter>/shortlist.safetensors; other tokens are never proposed), the
    # target's whole head in 4-bit codes made at load, its best tokens scored again by the 16-bit rows ("int4": the
    # full head's candidates for a quarter of its bytes a round), or "auto": "int4" for a 16-bit head of 1 GiB or more
    # beside a 16-bit target on a GPU that runs the mma kernel, outside exact mode (a 27B's), else "full"
    # (backends/dflash2/packed_head.py). mtp's drafts read it too ("shortlist" is dflash2's only), and so does the MTP
    # layer's slot 1 of a dflash2 drafter trained behind it, where the block's head is "int4".
    draft_head: str = choice("auto", "auto", "full", "shortlist", "int4")
    # The dflash2 drafter's projections: in the checkpoint's precision ("model"), float8 e4m3 with a scale per
    # output channel made at load ("fp8": a byte a weight, about 40% less drafter memory at the 27B shape, acceptance
    # unchanged, not faster on the H200; its products run ignis.quant.fp8's kernel on CUDA, the dequantized reference
    # elsewhere), 4-bit codes over groups of 128 input columns made at load ("int4": the 4-bit product of
    # ignis.quant.linear, as a quantized target's), the checkpoint's precision plus a 4-bit copy of the layers'
    # projections that rounds of one or two greedy lanes read ("int4-greedy": faster one-lane rounds for a quarter
    # more drafter memory; sampled rounds and the context's K/V keep the checkpoint's precision, so a seeded request
    # samples the same tokens alone and beside others), or "auto": "int4-greedy" for 16-bit layer projections of
    # 1 GiB or more on a GPU that runs the mma kernel, outside exact mode (a 27B's drafter), where the K/V pool keeps
    # its context and size beside the copy (settled at start-up from the memory free), else "model"
    # (backends/dflash2/greedy_copy.py). Drafts only propose: the output stays the target's.
    draft_weights: str = choice("auto", "auto", "model", "fp8", "int4", "int4-greedy")
    # Sampled requests: draw drafts from the drafter's own distribution q, shaped by the request's temperature, top-k,
    # top-p and min-p ("sampled"), or take its argmax, a one-hot q ("greedy"). Both keep the output exact; q that
    # follows the target accepts more.
    draft_sampling: str = choice("sampled", "sampled", "greedy")
    # How a sampled lane's drafts are judged: as one block ("block": block verification, ignis.engine.accept; as exact
    # as the token rule and never keeps fewer drafts on average) or draft by draft ("token": the classic rejection
    # rule). Greedy lanes keep the longest run equal to the argmax either way.
    verify: str = choice("block", "block", "token")
    drafter: str = text("")  # "" = <model>/drafter

    def __post_init__(self) -> None:
        check_section(self.section, self)
        # Looked up through the package so that tests (and embedders) can substitute the installed set.
        from ignis import config

        installed = config.installed_backends()
        names = ", ".join(f'"{n}"' for n in installed) or "none (is ignis installed?)"
        if self.backend not in installed and self.backend != AUTO:
            raise ConfigError("spec.backend", f'got "{self.backend}", which is not installed; expected "{AUTO}" or '
                              f"an installed backend: {names}")
        drafting = ", ".join(f'"{n}"' for n in installed if n != "off") or "none installed"
        if self.backend in ("off", AUTO) and self.draft_tokens != 0:
            raise ConfigError("spec.draft_tokens", f"spec.draft_tokens needs spec.backend set to a drafting backend "
                              f'({drafting}); got draft_tokens = {self.draft_tokens} with backend "{self.backend}": set '
                              f"spec.backend or leave spec.draft_tokens at 0")
        if self.backend == "dflash2" and self.draft_tokens == 0:
            raise ConfigError("spec.draft_tokens", f"required with dflash2; set spec.draft_tokens to "
                              f"1..{MAX_DRAFT_TOKENS}")
        if self.backend == "mtp" and self.draft_head == "shortlist":
            raise ConfigError("spec.draft_head", 'got "shortlist", the dflash2 drafter\'s own head; mtp takes "auto", '
                              '"full" or "int4"')
        if self.backend == "mtp" and self.draft_tokens == 0:
            # vLLM's default for MTP: one draft per round.
            object.__setattr__(self, "draft_tokens", 1)

    def drafter_dir(self, model_dir: Path) -> Path:
        """Where the drafter lives: `spec.drafter` when set, else beside the weights in `<model>/drafter`."""
        return Path(self.drafter) if self.drafter else model_dir / "drafter"


def _is_address(s: str) -> bool:
    return s == "" or re.fullmatch(r"(ipc|tcp)://\S+", s) is not None


@dataclass(frozen=True)
class ServerSection:
    section: ClassVar[str] = "server"

    host: str = text("127.0.0.1", pattern=lambda s: s != "", allowed="a host name or address")
    port: int = integer(8000, 0, 65535)  # 0 = any free port
    frontends: int = integer(1, 1, 64)  # front-end processes
    transport: str = choice("ipc", "ipc", "tcp")  # between front-ends and the GPU process
    engine_address: str = text("", pattern=_is_address, allowed='"" or an address "ipc://PATH" or "tcp://HOST:PORT"')
    heartbeat_s: float = number(1.0)
    engine_timeout_s: float = number(5.0)  # no heartbeat for this long = engine stuck or dead
    # Access: every route but /health needs "Authorization: Bearer KEY" once a key is set (here, by the `ignis`
    # command's IGNIS_SERVER_API_KEY, or in the file api_key_file). Never logged.
    api_key: str = text("")
    api_key_file: str = text("")
    cors_origins: str = text("")  # comma-separated origins a browser may call from ("*": any); "" = CORS off
    allowed_hosts: str = text("")  # comma-separated Host header values served ("*." prefixes allowed); "" = any
    # Limits on one HTTP request, checked before any work starts (ignis.server.limits).
    max_body_bytes: int = integer(32 * 2**20, 1024)  # request body; more is a 413 before it is read
    max_samples: int = integer(64, 1)  # choices per request: n x prompts
    max_stop: int = integer(16, 0)  # stop strings per request
    max_stop_chars: int = integer(1024, 1)  # characters per stop string
    max_prompt_chars: int = integer(0, 0, allowed="0 (64 x the engine's context) or a character count")  # per text prompt

    def __post_init__(self) -> None:
        check_section(self.section, self)
        if self.engine_address and not self.engine_address.startswith(f"{self.transport}://"):
            raise ConfigError("server.engine_address", f'got "{self.engine_address}" with server.transport = '
                              f'"{self.transport}"; the address must start with "{self.transport}://"')
        # One late heartbeat must not be taken for a dead engine.
        if self.engine_timeout_s < 2 * self.heartbeat_s:
            raise ConfigError("server.engine_timeout_s", f"got {self.engine_timeout_s}; expected at least twice "
                              f"server.heartbeat_s = {self.heartbeat_s}")


@dataclass(frozen=True)
class LogSection:
    section: ClassVar[str] = "log"

    level: str = choice("info", "debug", "info", "warning", "error")
    format: str = choice("console", "console", "json")

    def __post_init__(self) -> None:
        check_section(self.section, self)


@dataclass(frozen=True)
class IgnisConfig:
    """The whole resolved config. Built once at start, logged once, passed down, never mutated."""

    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineSection = field(default_factory=EngineSection)
    spec: SpecSection = field(default_factory=SpecSection)
    server: ServerSection = field(default_factory=ServerSection)
    log: LogSection = field(default_factory=LogSection)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), SECTIONS[f.name]):
                raise ConfigError(f.name, f"expected a {SECTIONS[f.name].__name__}, got {getattr(self, f.name)!r}")
        # The round verifies every lane's anchor plus its drafts in one forward.
        columns = self.engine.lanes * (self.spec.draft_tokens + 1)
        if self.engine.max_rows < columns:
            raise ConfigError("engine.max_rows", f"got {self.engine.max_rows}, fewer than the {columns} verify "
                              f"columns of one round (engine.lanes = {self.engine.lanes} x (spec.draft_tokens = "
                              f"{self.spec.draft_tokens} + 1)); raise engine.max_rows or lower engine.lanes")

    def redacted(self) -> dict[str, dict[str, Any]]:
        """`as_dict()` with secrets (server.api_key) masked: what logs may show."""
        out = self.as_dict()
        if out["server"]["api_key"]:
            out["server"]["api_key"] = "***"
        return out

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """Nested plain dict, section -> key -> value: for logging, the wire and `from_dict`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, Any]]) -> IgnisConfig:
        """Rebuild from `as_dict()` output (or any partial nested dict), refusing unknown sections and keys."""
        for name, table in data.items():
            if name not in SECTIONS:
                raise ConfigError(name, unknown_message(name, None))
            if not isinstance(table, dict):
                raise ConfigError(name, f"expected a table of keys, got {table!r}")
            for key in table:
                section_field(name, key)
        return cls(**{name: SECTIONS[name](**table) for name, table in data.items()})

    def to_toml(self) -> str:
        """TOML text that `load_config(path=...)` reads back to an equal config."""
        lines: list[str] = []
        for name, table in self.as_dict().items():
            lines.append(f"[{name}]")
            lines.extend(f"{key} = {_toml_value(value)}" for key, value in table.items())
            lines.append("")
        return "\n".join(lines)


SECTIONS: dict[str, type] = {
    "model": ModelSection, "engine": EngineSection, "spec": SpecSection, "server": ServerSection, "log": LogSection,
}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    # JSON string escapes (\", \\, \n, \uXXXX) are all valid TOML basic-string escapes.
    return json.dumps(value, ensure_ascii=False)


def unknown_message(section: str, key: str | None) -> str:
    """The refusal for an unknown section (key None) or key: what exists, and the closest match if any."""
    import difflib

    if key is None:
        names, typed, prefix = list(SECTIONS), section, ""
        head = f'unknown section "{section}"; sections are: '
    else:
        names = [f.name for f in dataclasses.fields(SECTIONS[section])]
        typed, prefix = key, f"{section}."
        head = f'unknown key "{section}.{key}"; keys in [{section}] are: '
    msg = head + ", ".join(names)
    close = difflib.get_close_matches(typed, names, n=1)
    return msg + (f'; did you mean "{prefix}{close[0]}"?' if close else "")


def section_field(section: str, key: str) -> dataclasses.Field[Any]:
    """The field behind `section.key`, or a ConfigError naming what exists."""
    if section not in SECTIONS:
        raise ConfigError(section if not key else f"{section}.{key}", unknown_message(section, None))
    for f in dataclasses.fields(SECTIONS[section]):
        if f.name == key:
            return f
    raise ConfigError(f"{section}.{key}", unknown_message(section, key))
