"""Worker flags of the embedding path (`tandem worker` with an engine that takes images) and
`attach_embedding_provider`, which gives the engine its cache + remote/local encoders."""

from __future__ import annotations

import argparse
import logging

from tandem.engines.base import Engine, ImageInput
from tandem.multimodal.embedding_cache import EmbeddingCache
from tandem.multimodal.embedding_transfer import EmbeddingReceiver
from tandem.multimodal.provider import LocalEmbeddingProvider
from tandem.multimodal.remote_provider import CachingEmbeddingProvider, RemoteEncoderClient
from tandem.runtime.runtime import Runtime
from tandem.transfer.base import BACKEND_NAMES, LAZY_BACKENDS
from tandem.transfer.config import backends_from_spec

logger = logging.getLogger(__name__)

MM_TRANSFER_BACKENDS_HELP = (
    f"image-embedding transfer backends, fastest preferred first (any of "
    f"{', '.join(BACKEND_NAMES)}); the missing optional ones are skipped. 'auto': all of them, "
    f"with {', '.join(LAZY_BACKENDS)} started only when a peer on another host needs them "
    "(named explicitly, they start at once)"
)


def add_embedding_provider_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("image embeddings")
    group.add_argument(
        "--mm-remote-encode",
        action="store_true",
        default=False,
        help="get image embeddings from encode workers (`tandem worker --engine encoder`); a "
        "failed encode or transfer falls back to this worker's encoder when it has one",
    )
    group.add_argument(
        "--no-mm-local-fallback",
        dest="mm_local_fallback",
        action="store_false",
        help="with --mm-remote-encode: never encode on this worker; a failed remote encode "
        "fails the request (503 when no encode worker answered)",
    )
    group.add_argument(
        "--mm-embedding-cache-mb",
        type=float,
        default=256.0,
        help="LRU of image embeddings by mm_hash; a hit skips the encoder; 0 = off",
    )
    group.add_argument(
        "--mm-encode-timeout-s",
        type=float,
        default=10.0,
        help="bound on asking encode workers (failover included) and pulling the embeddings; "
        "past it the request fails with 503",
    )
    group.add_argument(
        "--mm-transfer-backends",
        default="auto",
        help=f"with --mm-remote-encode: {MM_TRANSFER_BACKENDS_HELP}",
    )
    group.add_argument(
        "--mm-receive-slots",
        type=int,
        default=64,
        help="embeddings the pre-allocated receive pool holds at once",
    )


def _local_provider(images: ImageInput) -> LocalEmbeddingProvider | None:
    """EPD: the engine's own encoder, loaded on the first image (None when it has none)."""
    name, model = images.local_encoder, images.model
    if not name:
        return None
    from tandem.multimodal.registry import load_encoder

    return LocalEmbeddingProvider(lambda: load_encoder(name, model=model), name=name)


async def attach_embedding_provider(
    engine: Engine, runtime: Runtime, ns: argparse.Namespace
) -> CachingEmbeddingProvider | None:
    """Before the engine starts: give it cache → remote encoder (with `--mm-remote-encode`) →
    local encoder. None when the engine takes no images or has neither encoder."""
    images = engine.capabilities.images
    if images is None:
        return None
    cache = EmbeddingCache(int(ns.mm_embedding_cache_mb * (1 << 20)))
    local = _local_provider(images)
    remote = None
    if ns.mm_remote_encode and not ns.mm_local_fallback:
        local = None
    if ns.mm_remote_encode:
        from tandem.transfer import TransferAgent, TransferAgentConfig

        backends, lazy = backends_from_spec(ns.mm_transfer_backends)
        agent = TransferAgent(
            TransferAgentConfig(
                host=getattr(ns, "transfer_host", None) or "127.0.0.1",
                port=getattr(ns, "transfer_port", None) or 0,
                backends=backends,
                lazy_backends=lazy,
                cluster_secret=runtime.config.cluster_secret,  # peers prove the secret
                tls=runtime.config.tls,
            )
        )
        receiver = EmbeddingReceiver(agent, num_slots=ns.mm_receive_slots)
        remote = RemoteEncoderClient(runtime, receiver, timeout_s=ns.mm_encode_timeout_s)
        await remote.start()
    if remote is None and local is None:
        return None
    provider = CachingEmbeddingProvider(
        cache,
        remote=remote,
        local=local,
        to_tensor=(lambda a: a) if images.embeddings_as_arrays else None,
    )
    engine.attach_embedding_provider(provider)
    logger.info("image embeddings: cache %.0f MB, %s", ns.mm_embedding_cache_mb,
                "encode workers, local fallback" if remote and local else
                "encode workers" if remote else "in-process encoder")  # fmt: skip
    return provider
