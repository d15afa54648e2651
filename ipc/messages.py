"""The closed set of messages that cross between clients (front-ends, embedded clients) and the GPU process.

Owns: every message type, as msgspec structs tagged by kind, so a frame decodes to exactly one known type or is
refused. Does not own: encoding (ignis.ipc.codec) or transport (ignis.ipc.queues). The engine consumes
`EngineRequest` and produces `RequestDelta` whether it runs in-process or behind a socket.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from ignis.params import SamplingParams


class RequestStats(msgspec.Struct, kw_only=True):
    """Timings and speculation counts of one request, filled in as it runs and sent with its last delta."""

    prompt_tokens: int = 0
    prompt_tokens_resumed: int = 0  # of the prompt tokens, those a retained slot held: not prefilled again
    prompt_ms: float = 0.0
    decode_tokens: int = 0
    decode_ms: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    position_drafted: list[int] = msgspec.field(default_factory=list)
    position_accepted: list[int] = msgspec.field(default_factory=list)
    preemptions: int = 0  # times it gave its lane and K/V pages up and was prefilled again (ignis.engine.scheduler)

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.decode_tokens / self.decode_ms if self.decode_ms > 0 else 0.0

    def as_dict(self) -> dict:
        out = msgspec.structs.asdict(self)
        out["tokens_per_s"] = self.tokens_per_s
        return out


class EngineRequest(msgspec.Struct, tag="add", kw_only=True):
    """Add one generation. `stop_token_ids` is final: the client has merged EOS in unless `ignore_eos`."""

    id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    client: int = 0  # which front-end or client receives the deltas


class Abort(msgspec.Struct, tag="abort", kw_only=True):
    ids: list[str]


class RequestDelta(msgspec.Struct, tag="delta", kw_only=True):
    """New tokens of one request since its last delta. The last delta has `finished` and `stats` set."""

    id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_token_id: int | None = None
    stats: RequestStats | None = None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob} (chosen + top-N)


class EngineInfo(msgspec.Struct, kw_only=True):
    """What a client needs to know about the engine it talks to (sent in the ready handshake)."""

    model_name: str
    context: int
    lanes: int
    backend: str
    draft_tokens: int
    vocab_size: int
    eos_token_ids: list[int]
    draft_head: str = ""  # the proposal head a drafting backend settled on ("auto" resolved); "" where none


class Histogram(msgspec.Struct, kw_only=True):
    """Observations as plain data: `counts[i]` fell at or below `bounds[i]` (and above the bound before), the last
    count above every bound; `total` is their sum."""

    bounds: list[float]
    counts: list[int]
    total: float = 0.0


class EngineStats(msgspec.Struct, kw_only=True):
    """Engine-wide counters as plain data; only the server edge turns them into Prometheus metrics."""

    running: int = 0
    waiting: int = 0
    requests_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    speculative_requests: int = 0  # requests that ran with a drafting backend; metrics appear after the first
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    position_drafted: list[int] = msgspec.field(default_factory=list)
    position_accepted: list[int] = msgspec.field(default_factory=list)
    lanes: int = 0
    cache_bytes: int = 0  # the lanes' KV and recurrent state, allocated at start
    cache_used_bytes: int = 0  # the part that running requests hold: their positions' KV plus their lanes' state
    retained_slots: int = 0  # finished requests' lane states kept for a follow-up (on free lanes or the host)
    retained_hits: int = 0  # requests that resumed from a retained slot
    retained_misses: int = 0  # requests that found none to resume from (full prefill)
    prompt_tokens_resumed_total: int = 0  # prompt tokens the hits did not prefill again
    retained_host_bytes: int = 0  # host memory the retained slots moved off their lanes take
    retained_host_capacity_bytes: int = 0  # its bound (engine.retained_host_memory; 0 when nothing is retained)
    preemptions: int = 0  # requests pushed out of a lane to free K/V pages (requeued, prefilled again)
    kv_pages: int = 0  # pages in the attention K/V pool
    kv_pages_used: int = 0  # pages held by running requests and retained slots
    kv_pages_retained: int = 0  # of those, pages held by retained slots (given up first when pages run short)
    kv_page_positions: int = 0  # positions a page holds
    errors: dict[str, int] = msgspec.field(default_factory=dict)  # kind -> requests refused or ended by it
    histograms: dict[str, Histogram] = msgspec.field(default_factory=dict)  # name (ignis.engine.telemetry) -> data


# --- transport: what crosses the socket besides requests and deltas -------------------------------------------
# A client (front-end or embedded) sends ClientMessage frames; the GPU process sends EngineMessage frames. Each
# direction is its own closed union, so a frame of the wrong direction is refused like any unknown frame.


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    """A client announces itself (on every (re)connect); the engine answers with Ready once it can serve."""

    client: int
    pid: int = 0
    secret: str = ""  # the per-start secret of a tcp engine; nothing else is taken from a client before it matches


class UtilityCall(msgspec.Struct, tag="call", kw_only=True):
    """A request/reply call beside the request stream. `method` is a closed set, checked when the frame decodes."""

    call_id: int
    method: Literal["stats"]


class Ready(msgspec.Struct, tag="ready", kw_only=True):
    """The engine serves; `info` is what clients need (model name, context, lanes, backend, draft width)."""

    info: EngineInfo
    pid: int = 0
    heartbeat_s: float = 1.0


class Heartbeat(msgspec.Struct, tag="beat", kw_only=True):
    """Sent to every client each `server.heartbeat_s`, also while a round runs; its absence for
    `server.engine_timeout_s` means the process is dead or frozen. `round_s` is how long the round in progress has
    run (0 between rounds): a round longer than the timeout means the engine is stuck inside it."""

    seq: int
    round_s: float = 0.0


class Deltas(msgspec.Struct, tag="deltas", kw_only=True):
    """Every delta one round produced for one client, in one frame."""

    deltas: list[RequestDelta]


class Rejected(msgspec.Struct, tag="rejected", kw_only=True):
    """A frame the engine refused before any work, so no sender waits for an answer that never comes. `kind`:
    "input" and "queue_full" for an EngineRequest (HTTP 400 vs 503); "malformed" for a frame that did not decode
    (`id` is the request's when it could be read, else ""); "unauthenticated" for anything from a client that has
    not said the engine's secret."""

    id: str
    kind: Literal["input", "queue_full", "malformed", "unauthenticated"]
    message: str
    field: str | None = None


class UtilityReply(msgspec.Struct, tag="reply", kw_only=True):
    call_id: int
    stats: EngineStats | None = None
    error: str | None = None


class EngineDead(msgspec.Struct, tag="dead", kw_only=True):
    """The last frame of a GPU process that hit an unrecoverable error (or failed to start); every request fails."""

    reason: str
    kind: Literal["artifact", "config", "internal"] = "internal"  # clients raise ArtifactError / ConfigError / ...
    key: str | None = None  # the config key at fault, for kind "config"


ClientMessage = Union[Hello, EngineRequest, Abort, UtilityCall]
EngineMessage = Union[Ready, Heartbeat, Deltas, Rejected, UtilityReply, EngineDead]
