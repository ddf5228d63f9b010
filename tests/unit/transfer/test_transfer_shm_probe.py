"""The shared-memory proof's two halves (`shm.ShmProbe`, `shm.ShmProofs`): a probe read back
with its digest proves a shared /dev/shm; a missing segment, another token or a name outside
tandem's segments does not; verdicts are kept per probe; `close` removes the segment."""

from __future__ import annotations

import os

import pytest

import tandem.transfer.shm as shm
from tandem.transfer.region import SHM_DIR


def test_a_probe_read_back_proves_shared_memory_once() -> None:
    probe = shm.ShmProbe()
    proofs = shm.ShmProofs()
    try:
        assert proofs.why_not_shared(probe.name, probe.digest) is None
        os.unlink(os.path.join(SHM_DIR, probe.name))  # the verdict is kept, not read again
        assert proofs.why_not_shared(probe.name, probe.digest) is None
    finally:
        probe.close()
    assert not os.path.exists(os.path.join(SHM_DIR, probe.name))


@pytest.mark.parametrize("case", ["missing", "other token", "bad name", "none"])
def test_what_proves_nothing(case: str) -> None:
    probe = shm.ShmProbe()
    name, digest = probe.name, probe.digest
    if case == "missing":
        probe.close()
    elif case == "other token":
        digest = bytes(32)
    elif case == "bad name":
        name = "../etc/passwd"
    elif case == "none":
        name = ""
    try:
        why = shm.ShmProofs().why_not_shared(name, digest)
    finally:
        probe.close()
    expected = {
        "missing": "is not visible here",
        "other token": "holds another token",
        "bad name": "is not a tandem probe name",
        "none": "named no shared-memory probe",
    }
    assert why is not None and expected[case] in why
