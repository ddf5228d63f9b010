"""`--mm-transfer-backends` on both ends of an image-embedding transfer (the encode worker and
a worker with `--mm-remote-encode`): 'auto' starts nixl and mooncake only for a peer on
another host (an idle NIXL agent polls UCX all the time; a one-host stack never needs one);
backends named explicitly start at once, so one host can use NIXL too."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

from tandem.engines.base import EngineCapabilities, EngineDefaults, ImageInput
from tandem.multimodal import encode_args, provider_args
from tandem.transfer.config import backends_from_spec


def test_auto_is_every_backend_with_the_busy_ones_lazy_and_a_list_is_eager() -> None:
    assert backends_from_spec("auto") == (("shm", "nixl", "mooncake", "tcp"), ("nixl", "mooncake"))
    assert backends_from_spec(" nixl, tcp ") == (("nixl", "tcp"), ())
    with pytest.raises(ValueError, match="expected 'auto' or a comma-separated list"):
        backends_from_spec(" , ")


def test_encoder_flag() -> None:
    parser = argparse.ArgumentParser()
    encode_args.add_args(parser)
    auto = encode_args.config_from_args(parser.parse_args([]))
    assert auto.transfer_lazy_backends == ("nixl", "mooncake") and "nixl" in auto.transfer_backends
    named = encode_args.config_from_args(parser.parse_args(["--mm-transfer-backends", "nixl,tcp"]))
    assert (named.transfer_backends, named.transfer_lazy_backends) == (("nixl", "tcp"), ())


class _Image(EngineDefaults):  # an engine that takes images, with no encoder of its own
    capabilities = EngineCapabilities(images=ImageInput())
    embedding_provider: Any = None

    def attach_embedding_provider(self, provider: Any) -> None:
        self.embedding_provider = provider


@pytest.mark.parametrize(
    ("argv", "backends", "lazy"),
    [([], ("shm", "nixl", "mooncake", "tcp"), ("nixl", "mooncake")),
     (["--mm-transfer-backends", "nixl,tcp"], ("nixl", "tcp"), ())],
)  # fmt: skip
async def test_receiver_agent_follows_the_worker_flag(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], backends: tuple, lazy: tuple
) -> None:
    configs = []

    class Client:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        async def start(self) -> None:
            pass

    monkeypatch.setattr("tandem.transfer.TransferAgent", configs.append)
    monkeypatch.setattr(provider_args, "EmbeddingReceiver", lambda agent, num_slots: None)
    monkeypatch.setattr(provider_args, "RemoteEncoderClient", Client)
    parser = argparse.ArgumentParser()
    provider_args.add_embedding_provider_args(parser)
    ns = parser.parse_args(["--mm-remote-encode", *argv])
    runtime = SimpleNamespace(config=SimpleNamespace(cluster_secret=None, tls=None))
    assert await provider_args.attach_embedding_provider(_Image(), runtime, ns) is not None
    [config] = configs
    assert (config.backends, config.lazy_backends) == (backends, lazy)
