"""The vision encoder tandem ships: MobileNetV2 (ImageNet) + the classifier bridge into the LM's
input-embedding space (see `classifier_bridge.py` for what it can and cannot do)."""
