"""Topology wiring: `tandem serve --encode-workers` specs; the decode leg without image bytes."""

from __future__ import annotations

from tandem.cli.serve import _validate, build_parser, worker_specs
from tandem.disagg.params import without_image_bytes
from tandem.protocols.engine import MmItem, PreprocessedRequest, StopConditions


def _specs(*argv: str):
    args, passthrough = build_parser().parse_known_args(list(argv))
    _validate(args)
    return worker_specs(args, passthrough)


def test_encode_workers_are_encoder_components_and_others_ask_them() -> None:
    specs = _specs("--engine", "native", "--encode-workers", "2", "--workers", "1",
                   "--num-threads", "2",
                   "--encoder-args", "--mm-encoder-batch-images 4")  # fmt: skip
    encoders = [s for s in specs if s.component == "encoder"]
    assert [(s.name, s.endpoint) for s in encoders] == [
        ("encoder0", "encode"),
        ("encoder1", "encode"),
    ]
    assert "--mm-encoder-batch-images" in encoders[0].argv
    assert "--num-threads" not in encoders[0].argv  # serve's passthrough is for the LM workers
    [lm] = [s for s in specs if s.component == "backend"]
    assert "--mm-remote-encode" in lm.argv and "--num-threads" in lm.argv


def test_mocker_stacks_get_simulated_encoders_and_epd_has_none() -> None:
    specs = _specs("--engine", "mocker", "--encode-workers", "1", "--prefill-workers", "1",
                   "--decode-workers", "1")  # fmt: skip
    [enc] = [s for s in specs if s.component == "encoder"]
    assert enc.argv[enc.argv.index("--mm-encoder") + 1] == "sim"
    assert all("--mm-remote-encode" in s.argv for s in specs if s.component != "encoder")
    plain = _specs("--engine", "native", "--workers", "2")
    assert all(s.component == "backend" and "--mm-remote-encode" not in s.argv for s in plain)


def test_decode_leg_keeps_hashes_and_rows_but_not_bytes() -> None:
    item = MmItem(mm_hash=7, offset=3, num_tokens=50, image_bytes=b"png")
    request = PreprocessedRequest(request_id="r", model="m", token_ids=[1] * 60,
                                  stop=StopConditions(max_tokens=1), mm_items=[item])  # fmt: skip
    leg = without_image_bytes(request)
    assert leg.mm_items == [MmItem(mm_hash=7, offset=3, num_tokens=50)]
    assert request.mm_items[0].image_bytes == b"png"  # the original is untouched
