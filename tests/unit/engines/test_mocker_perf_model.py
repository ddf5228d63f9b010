from __future__ import annotations

import pytest

from tandem.engines.mocker import perf_model


def test_prefill_polynomial_values() -> None:
    assert perf_model.prefill_ms(0) == 0.0
    assert perf_model.prefill_ms(1000) == pytest.approx(0.4209989 + 15.18344 + 16.50142)
    assert perf_model.prefill_ms(8192) == pytest.approx(
        4.209989e-7 * 8192**2 + 1.518344e-2 * 8192 + 16.50142
    )


def test_prefill_batch_form_uses_uncached_tokens() -> None:
    # 4 sequences of mean ISL 600 with 100 cached each → T = 2000
    assert perf_model.prefill_ms_for_batch(4, 600, 100) == pytest.approx(
        perf_model.prefill_ms(2000)
    )


def test_decode_polynomial_and_clamping() -> None:
    assert perf_model.decode_ms(0.0) == pytest.approx(5.74)
    assert perf_model.decode_ms(0.5) == pytest.approx(-25.74 / 4 + 54.01 / 2 + 5.74)
    assert perf_model.decode_ms(1.0) == pytest.approx(34.01)
    assert perf_model.decode_ms(3.0) == perf_model.decode_ms(1.0)


def test_step_is_prefill_plus_one_decode_pass() -> None:
    assert perf_model.step_ms(0, 0, 0.3) == 0.0
    assert perf_model.step_ms(100, 0, 0.3) == pytest.approx(perf_model.prefill_ms(100))
    assert perf_model.step_ms(100, 7, 0.3) == pytest.approx(
        perf_model.prefill_ms(100) + perf_model.decode_ms(0.3)
    )
