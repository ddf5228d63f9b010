"""Wire messages between frontends (`--router remote`) and the `tandem router` service.

Endpoints of the service, on the request plane (version 1, msgpack):
- `{ns}.router.route`: RouteRequest → one RouteResponse (or the router's ServingError:
  Overloaded with retry_after_s, NoWorkersAvailable, InvalidRequest for a bad pin).
- `{ns}.router.first_token` / `{ns}.router.free`: RouterNoticeMsg → no payload; the listed
  requests finished prefill / finished (idempotent, unknown ids ignored).
- `{ns}.router.explain`: RouteRequest → one msgpack map, the router's `explain` of it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.protocols.engine import PreprocessedRequest

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


class RouterNoticeMsg(msgspec.Struct, kw_only=True, omit_defaults=True):
    version: int = 1
    request_ids: list[str]


_encoder = msgspec.msgpack.Encoder()
route_request_decoder = msgspec.msgpack.Decoder(RouteRequest)
route_response_decoder = msgspec.msgpack.Decoder(RouteResponse)
notice_decoder = msgspec.msgpack.Decoder(RouterNoticeMsg)


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)
