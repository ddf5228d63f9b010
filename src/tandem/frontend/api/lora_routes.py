"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (vLLM's shapes and answers:
a plain-text "Success: ..." line, errors as OpenAI error bodies); the work is
`frontend/adapters.py`'s. Admin routes when API keys are configured (`auth.py`)."""

from __future__ import annotations

import msgspec

from tandem.errors import InvalidRequest
from tandem.frontend.adapters import LoraAdapters
from tandem.frontend.api.request_input import decode_body
from tandem.frontend.http.message import HttpRequest, HttpResponse
from tandem.protocols.lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
_load = msgspec.json.Decoder(LoadLoraAdapterRequest)
_unload = msgspec.json.Decoder(UnloadLoraAdapterRequest)
_TEXT = b"text/plain; charset=utf-8"


class LoraRoutes:
    def __init__(self, adapters: LoraAdapters) -> None:
        self.adapters = adapters

    async def load(self, request: HttpRequest, response: HttpResponse) -> None:
        req = decode_body(_load, request.body)
        if not req.lora_name or not req.lora_path:
            raise InvalidRequest("Both 'lora_name' and 'lora_path' must be provided.")
        for field in ("load_inplace", "is_3d_lora_weight"):
            if getattr(req, field):
                raise InvalidRequest(
                    f"{field}=true is not supported: tandem loads an adapter once per name "
                    "(unload it, then load it again)",
                    param=field,
                )
        await self.adapters.load_request(req.lora_name, req.lora_path, req.base_model_name)
        text = f"Success: LoRA adapter '{req.lora_name}' added successfully."
        await response.send(200, text.encode(), content_type=_TEXT)

    async def unload(self, request: HttpRequest, response: HttpResponse) -> None:
        req = decode_body(_unload, request.body)
        if not req.lora_name:
            raise InvalidRequest("'lora_name' needs to be provided to unload a LoRA adapter.")
        await self.adapters.unload(req.lora_name)
        text = f"Success: LoRA adapter '{req.lora_name}' removed successfully."
        await response.send(200, text.encode(), content_type=_TEXT)
