"""Weights copied onto the huge-page mapping keep their values, shapes and dtypes, each on
its own page, the first on a 2 MiB boundary."""

from __future__ import annotations

import torch

from tandem.engines.native.arena import ALIGN, HUGE_PAGE, huge_page_copies


def test_copies_are_equal_aligned_and_independent_of_the_originals():
    tensors = [torch.randn(7, 5), torch.randn(3).to(torch.bfloat16), torch.arange(10.0)]
    copies = huge_page_copies(tensors)
    assert [c.dtype for c in copies] == [t.dtype for t in tensors]
    assert all(
        torch.equal(c, t) and c.is_contiguous() for c, t in zip(copies, tensors, strict=True)
    )
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    assert all(c.data_ptr() % ALIGN == 0 for c in copies)
    tensors[0].zero_()
    assert copies[0].abs().sum() > 0  # a copy, not a view of the original


def test_empty_list_is_returned_as_is():
    assert huge_page_copies([]) == []
