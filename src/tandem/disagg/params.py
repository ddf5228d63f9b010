"""`DisaggParams`: what travels in `PreprocessedRequest.disagg_params` / `EngineOutput.
disagg_params` between the frontend, the prefill worker and the decode worker (version 1).

Three shapes, told apart by ``mode``:
- ``pull`` (prefill-first): the prefill's readable op (``meta``, an encoded
  `TransferOpMeta`); the decode pulls it. ``num_tokens`` prompt tokens are covered; the
  decode request's ``token_ids`` are prompt + the prefill's first token.
- ``rendezvous`` (decode-first, to the decode worker): create a writable op ``op_id`` for
  the prompt's blocks and wait for a prefill to push into it (the push's annex carries the
  prefill's first output; the decode resumes after it).
- ``push`` (decode-first, to the prefill worker): push the prompt's KV to the decode
  agent at ``address`` into op ``op_id`` (the op may not exist yet; the owner waits).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from tandem.errors import InvalidRequest
from tandem.protocols.engine import PreprocessedRequest

Mode = Literal["pull", "rendezvous", "push"]
PINNED_ANNOTATION = "tandem.disagg.pinned"  # the frontend pinned this leg to a worker


class DisaggParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    version: int = 1
    mode: Mode
    num_tokens: int = 0  # prompt tokens whose KV is handed over
    meta: bytes = b""  # pull: encode_meta(TransferOpMeta)
    op_id: str = ""  # rendezvous / push
    address: tuple[str, int] = ("", 0)  # push: the decode agent's control address
    agent_id: str = ""
    expires_at: float = 0.0  # unix time after which the source gives the blocks up
    prefill_instance_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        out["meta"] = self.meta  # keep bytes as bytes (msgpack carries them)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DisaggParams:
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"bad disagg_params: {exc}", param="disagg_params") from exc


def without_image_bytes(request: PreprocessedRequest) -> PreprocessedRequest:
    """A decode leg's copy of `request`: each image keeps its mm_hash and rows (block hashes)
    but not its bytes — the decode worker gets the KV, never the image."""
    if not request.mm_items:
        return request
    items = [msgspec.structs.replace(i, image_bytes=None) for i in request.mm_items]
    return msgspec.structs.replace(request, mm_items=items)
