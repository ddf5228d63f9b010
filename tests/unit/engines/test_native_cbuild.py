"""The kernel cache key: a library is rebuilt when its source, a header beside it, the
compiler or the flags change (kernels/vmath.h is shared by ops.c and quant.c)."""

from __future__ import annotations

from pathlib import Path

from tandem.engines.native.cbuild import library_path


def test_cache_key_covers_the_headers_beside_the_source(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "k.c"
    src.write_text('#include "h.h"\nint f(void) { return H; }\n')
    header = tmp_path / "h.h"
    header.write_text("#define H 1\n")
    first = library_path(src, "k", "gcc", ("-O3",))
    assert library_path(src, "k", "gcc", ("-O3",)) == first
    header.write_text("#define H 2\n")
    second = library_path(src, "k", "gcc", ("-O3",))
    assert second != first
    assert library_path(src, "k", "gcc", ("-O2",)) != second
    assert second.parent == tmp_path / "cache" / "kernels"
