"""The classifier-bridge encoder: the MobileNetV2 checkpoint really classifies real photos, and
the bridge turns features into SmolLM2-space rows of the documented shape and norm."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.support.images import photo_bytes

from tandem.multimodal.encoder.bridge import (
    BridgeConfig,
    ClassifierBridge,
    class_name_embeddings,
    imagenet_class_names,
)
from tandem.multimodal.encoder.classifier_bridge import (
    ClassifierBridgeEncoder,
    EncoderConfig,
    load_classifier_bridge,
)
from tandem.multimodal.encoder.mobilenet import MobileNetV2
from tandem.multimodal.encoder.preprocess import image_tensor
from tandem.multimodal.image import decode_image

CAT_CLASSES = {"tabby", "tiger cat", "Egyptian cat", "Persian cat", "Siamese cat"}


@pytest.fixture(scope="module")
def network() -> MobileNetV2:
    return MobileNetV2.from_checkpoint()


@pytest.fixture(scope="module")
def encoder() -> ClassifierBridgeEncoder:
    return load_classifier_bridge()


def _pixels(name: str) -> np.ndarray:
    return decode_image(photo_bytes(name)).pixels


def _top1(network: MobileNetV2, name: str) -> tuple[str, float]:
    with torch.inference_mode():
        probs = torch.softmax(network(image_tensor(_pixels(name)).unsqueeze(0)), dim=-1)[0]
    index = int(probs.argmax())
    return imagenet_class_names()[index], float(probs[index])


def test_class_names_are_imagenet_order() -> None:
    names = imagenet_class_names()
    assert len(names) == 1000
    assert (names[0], names[281], names[967]) == ("tench", "tabby", "espresso")


def test_checkpoint_classifies_cat_photo_as_a_cat(network: MobileNetV2) -> None:
    label, _ = _top1(network, "chelsea.png")
    assert label in CAT_CLASSES


def test_checkpoint_classifies_coffee_photo_as_espresso(network: MobileNetV2) -> None:
    label, prob = _top1(network, "coffee.png")
    assert label == "espresso"
    assert prob > 0.9


def test_feature_map_is_7x7x1280(network: MobileNetV2) -> None:
    with torch.inference_mode():
        features = network.features(image_tensor(_pixels("coffee.png")).unsqueeze(0))
    assert tuple(features.shape) == (1, 1280, 7, 7)


def test_wrong_checkpoint_is_a_clear_error(tmp_path) -> None:
    bad = tmp_path / "bad.pth"
    torch.save({"features.0.0.weight": torch.zeros(32, 3, 3, 3)}, bad)
    with pytest.raises(ValueError, match=r"missing tensor 'features\.0\.1\.weight'"):
        MobileNetV2.from_checkpoint(bad)


def test_image_tensor_resizes_any_shape_to_224() -> None:
    tall = np.zeros((500, 90, 3), dtype=np.uint8)
    assert tuple(image_tensor(tall).shape) == (3, 224, 224)
    with pytest.raises(ValueError, match="uint8 HxWx3"):
        image_tensor(np.zeros((4, 4), dtype=np.uint8))


def test_encoder_rows_have_protocol_shape_and_token_norm(encoder: ClassifierBridgeEncoder) -> None:
    images = [decode_image(photo_bytes(n)) for n in ("chelsea.png", "coffee.png", "rocket.jpg")]
    rows = encoder.encode(images)
    assert encoder.num_tokens_per_image == 50
    assert encoder.hidden_size == 576
    assert [tuple(r.shape) for r in rows] == [(50, 576)] * 3
    assert all(r.dtype == torch.float32 for r in rows)
    norms = torch.stack([r.norm(dim=-1) for r in rows])
    assert torch.allclose(norms, torch.full_like(norms, encoder.bridge.target_norm), rtol=1e-4)
    assert not torch.allclose(rows[0], rows[1], atol=1e-3)  # a cat is not a coffee


def test_global_row_is_near_the_top_class_name(encoder: ClassifierBridgeEncoder) -> None:
    row = encoder.encode([decode_image(photo_bytes("coffee.png"))])[0][-1]
    names = encoder.bridge.class_embeddings
    cosine = torch.nn.functional.cosine_similarity(names, row.unsqueeze(0), dim=-1)
    assert imagenet_class_names()[int(cosine.argmax())] == "espresso"


def test_batching_splits_at_max_batch(encoder: ClassifierBridgeEncoder) -> None:
    small = ClassifierBridgeEncoder(encoder.network, encoder.bridge, max_batch=2)
    images = [decode_image(photo_bytes("coffee.png"))] * 5
    rows = small.encode(images)
    assert len(rows) == 5
    assert all(torch.allclose(r, rows[0], atol=1e-4) for r in rows)


def _toy_bridge(config: BridgeConfig) -> ClassifierBridge:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 1280, generator=gen) * 0.05
    classes = torch.eye(1000, 8)  # class i -> basis vector i (first 8 classes only)
    return ClassifierBridge(weight, torch.zeros(1000), classes, 2.0, config)


def test_top_k_mixes_only_the_top_classes() -> None:
    bridge = _toy_bridge(BridgeConfig(temperature=2.0))  # > 1: top-5 by default
    assert bridge.config.effective_top_k == 5
    logits = torch.randn(3, 1000)
    weights = bridge._mixing_weights(logits)
    assert ((weights > 0).sum(dim=-1) == 5).all()
    assert torch.allclose(weights.sum(dim=-1), torch.ones(3))
    assert BridgeConfig(temperature=0.7).effective_top_k is None


def test_lower_temperature_sharpens_rows() -> None:
    logits = torch.randn(4, 1000) * 3
    sharp = _toy_bridge(BridgeConfig(temperature=0.5))._mixing_weights(logits).max(dim=-1).values
    flat = _toy_bridge(BridgeConfig(temperature=1.0))._mixing_weights(logits).max(dim=-1).values
    assert (sharp > flat).all()


def test_bad_config_values_name_the_field() -> None:
    with pytest.raises(ValueError, match="temperature=0"):
        BridgeConfig(temperature=0.0)
    with pytest.raises(ValueError, match="top_k=0"):
        BridgeConfig(top_k=0)
    with pytest.raises(ValueError, match="max_batch_images=0"):
        EncoderConfig(max_batch_images=0)


def test_class_name_embeddings_average_token_rows() -> None:
    table = torch.arange(12, dtype=torch.float32).view(6, 2)
    out = class_name_embeddings(["a", "b"], [[0, 2], [5]], table)
    assert torch.equal(out, torch.tensor([[2.0, 3.0], [10.0, 11.0]]))
    with pytest.raises(ValueError, match="no tokens"):
        class_name_embeddings(["empty"], [[]], table)
