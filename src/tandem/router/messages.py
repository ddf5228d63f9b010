"""Wire messages between frontends (`--router remote`) and the `tandem router` service.

Endpoints of the service, on the request plane (version 1, msgpack):
- `{ns}.router.route`: RouteRequest → one RouteResponse (or the router's ServingError:
  Overloaded with retry_after_s, NoWorkersAvailable, InvalidRequest for a bad pin).
- `{ns}.router.first_token` / `{ns}.router.free`: RouterNoticeMsg → no payload; the listed
  requests finished prefill / finished (idempotent, unknown ids ignored); a `free` notice's
  `output_tokens` are the tokens each generated (−1: not known), for the fair-share charge.
- `{ns}.router.explain`: RouteRequest → one msgpack map, the router's `explain` of it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.protocols.engine import KvFetchHint, PreprocessedRequest
from tandem.protocols.openai import ParsedTokenIds

ROUTER_COMPONENT = "router"


class RouteRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    version: int = 1
    request: PreprocessedRequest
    exclude: list[str] = msgspec.field(default_factory=list)


class RouteResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    version: int = 1
    instance_id: str
    address: str
    overlap_blocks: int = 0
    request_blocks: int = 0
    details: dict[str, Any] = msgspec.field(default_factory=dict)
    kv_fetch: KvFetchHint | None = None  # the KV router's peer fetch for the chosen worker


class RouterNoticeMsg(msgspec.Struct, kw_only=True, omit_defaults=True):
    version: int = 1
    request_ids: list[str]
    output_tokens: list[int] | None = None  # `free`: per request id, -1 = not known


def _enc_hook(obj: Any) -> Any:
    """A prompt the frontend parsed straight into u32s (`ParsedTokenIds`) goes out as the list
    of ids it stands for."""
    if isinstance(obj, ParsedTokenIds):
        return list(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__} in a router message")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
route_request_decoder = msgspec.msgpack.Decoder(RouteRequest)
route_response_decoder = msgspec.msgpack.Decoder(RouteResponse)
notice_decoder = msgspec.msgpack.Decoder(RouterNoticeMsg)


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)
