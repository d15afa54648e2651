"""The msgpack codec of the wire: typed structs in, bytes out, and back, with no pickle anywhere.

Owns: encoding any message of ignis.ipc.messages and decoding a frame into exactly one message of the direction
expected. A frame that is not valid msgpack, carries an unknown tag, or fails a field's validation is logged and
dropped (decode returns None; `refusal_of` reads what a reply needs from it): a bad peer can never crash the
receiver. Does not own: sockets (ignis.ipc.queues).
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

from ignis.ipc.messages import ClientMessage, EngineMessage
from ignis.logging import get_logger

log = get_logger(__name__)

M = TypeVar("M")

_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


class Decoder(Generic[M]):
    """Decodes frames of one direction; counts what it dropped so tests and logs can see it."""

    def __init__(self, union: type[M], direction: str) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)
        self._direction = direction
        self.dropped = 0
        self.error = ""  # why the last frame that decoded to None was dropped

    def decode(self, frame: bytes) -> M | None:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.dropped += 1
            self.error = str(e)[:200]  # bounded: a flood of garbage must not flood the log with its own bytes
            log.warning("ignis.ipc.dropped_frame", direction=self._direction, error=self.error, size=len(frame))
            return None


def refusal_of(frame: bytes, error: str) -> tuple[str, str | None]:
    """(request id, field) of a frame that failed validation, as far as they can be read: a reply can then name
    the request the sender waits on. ("", None) when the frame is not even a msgpack map with a string id."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except (msgspec.DecodeError, RecursionError):
        return "", None
    rid = raw.get("id") if isinstance(raw, dict) else None
    field = error.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in error else None
    return (rid if isinstance(rid, str) else ""), field


def client_decoder() -> Decoder[ClientMessage]:
    """What the GPU process reads: frames sent by clients."""
    return Decoder(ClientMessage, "client->engine")  # type: ignore[arg-type]


def engine_decoder() -> Decoder[EngineMessage]:
    """What clients read: frames sent by the GPU process."""
    return Decoder(EngineMessage, "engine->client")  # type: ignore[arg-type]
