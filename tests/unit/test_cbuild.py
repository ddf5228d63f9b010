"""The kernel cache key: a library is rebuilt when its source, a header beside it, the
compiler or the flags change (kernels/vmath.h is shared by ops.c and quant.c); and the
instruction-set build the native kernels run (cbuild.select_isa, TANDEM_NATIVE_ISA)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tandem import cbuild
from tandem.cbuild import library_path


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


# ------------------------------------------------------------------ instruction-set builds
AVX2_CPU = frozenset({"sse2", "avx", "avx2", "fma", "f16c"})
VNNI_CPU = AVX2_CPU | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}


def test_the_widest_build_the_cpu_flags_allow_is_chosen_and_logged(monkeypatch, caplog):
    monkeypatch.delenv(cbuild.ISA_ENV, raising=False)
    monkeypatch.setattr(cbuild, "_logged", set())  # each choice is logged once a process
    caplog.set_level(logging.INFO, logger="tandem.cbuild")
    assert cbuild.select_isa(VNNI_CPU)[0] == "avx512vnni"
    assert cbuild.select_isa(VNNI_CPU - {"avx512_vnni"})[0] == "avx512"
    isa, why = cbuild.select_isa(AVX2_CPU)
    assert isa == "avx2" and "avx2 f16c fma" in why and "avx512" not in why
    assert cbuild.select_isa(AVX2_CPU - {"f16c"})[0] == "scalar"
    assert cbuild.select_isa(frozenset())[0] == "scalar"
    assert cbuild.runnable_isas(AVX2_CPU) == ["avx2", "scalar"]
    assert cbuild.runnable_isas(VNNI_CPU) == list(cbuild.ISAS)
    assert f"native kernels: the avx2 build, {why}" in caplog.text
    # this machine: its widest build, which it executes
    assert cbuild.select_isa()[0] == cbuild.runnable_isas()[0]


def test_a_forced_build_is_used_where_the_cpu_runs_it_and_refused_where_not(monkeypatch, caplog):
    monkeypatch.setattr(cbuild, "_logged", set())
    caplog.set_level(logging.INFO, logger="tandem.cbuild")
    for isa in ("scalar", "avx2"):
        monkeypatch.setenv(cbuild.ISA_ENV, isa)
        assert cbuild.select_isa(AVX2_CPU) == (isa, f"forced by {cbuild.ISA_ENV}={isa}")
        assert f"native kernels: the {isa} build, forced by" in caplog.text
    monkeypatch.setenv(cbuild.ISA_ENV, "avx512vnni")
    assert cbuild.select_isa(VNNI_CPU)[0] == "avx512vnni"
    with pytest.raises(cbuild.IsaError, match=r"'avx512vnni' needs CPU flags .*avx512_vnni.*"
                       r"this CPU lacks; it runs: avx2, scalar"):  # fmt: skip
        cbuild.select_isa(AVX2_CPU)
    monkeypatch.setenv(cbuild.ISA_ENV, "sse4")
    with pytest.raises(cbuild.IsaError, match="TANDEM_NATIVE_ISA='sse4'; expected one of: auto, "):
        cbuild.select_isa(AVX2_CPU)
    monkeypatch.setenv(cbuild.ISA_ENV, "auto")
    assert cbuild.select_isa(AVX2_CPU)[0] == "avx2"


def test_kernels_never_load_a_build_the_cpu_cannot_execute(monkeypatch, tmp_path):
    """On a CPU without AVX-512 (this one, or one the flags pretend) a forced AVX-512 build
    is an IsaError from the quantized kernels and from the C ops alike: never a library
    loaded to die of SIGILL at its first call."""
    from tandem.engines.native import ops, quant

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cbuild, "cpu_flags", lambda: AVX2_CPU)
    for isa in ("avx512vnni", "avx512"):
        with pytest.raises(cbuild.IsaError, match=f"'{isa}' needs CPU flags"):
            quant.build(isa)
        with pytest.raises(cbuild.IsaError, match=f"'{isa}' needs CPU flags"):
            ops.build(isa=isa)
        monkeypatch.setenv(cbuild.ISA_ENV, isa)
        with pytest.raises(cbuild.IsaError, match="this CPU lacks"):
            quant.kernels()
        with pytest.raises(cbuild.IsaError, match="this CPU lacks"):
            ops.library()
    assert not list(tmp_path.rglob("*.so"))  # nothing was compiled for it either


def test_each_build_is_its_own_library(monkeypatch):
    """Forcing the scalar build gives libraries of their own (the name and the cache key
    carry the build), whose kernels run the scalar path, beside the serving build's."""
    from tandem.engines.native import ops, quant

    monkeypatch.setenv(cbuild.ISA_ENV, "scalar")
    lib, c_ops = quant.kernels(), ops.library()
    assert lib.tq_isa() == 0 and c_ops is not None and c_ops.to_has_avx2() == 0
    assert quant.build().name.startswith("tq-scalar-")
    assert ops.build().name.startswith("ops-scalar-")
    monkeypatch.delenv(cbuild.ISA_ENV)
    widest = cbuild.runnable_isas()[0]
    assert quant.build().name.startswith(f"tq-{widest}-")
    if widest != "scalar":
        assert quant.kernels() is not lib and quant.kernels().tq_isa() > 0
        assert ops.library() is not c_ops
