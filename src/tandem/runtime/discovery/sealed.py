"""A discovery record as stored by the file and etcd backends: its JSON bytes as written and
an HMAC tag over them (and over whatever else the backend binds it to, such as the etcd key),
keyed by a key derived from the cluster secret; no tag without a secret."""

from __future__ import annotations

import msgspec

from tandem.runtime.secret import is_valid_tag, tag


class SealedRecord(msgspec.Struct, kw_only=True):
    """The record's JSON bytes as written, and their HMAC tag (hex; empty without a secret)."""

    record: msgspec.Raw
    tag: str = ""


class ForgedRecordError(ValueError):
    """A record whose tag does not verify with this process's cluster secret."""


def seal(body: bytes, key: bytes | None, *bound: bytes) -> bytes:
    """`body` sealed: tagged over `bound` + `body` when there is a key."""
    sealed = SealedRecord(record=msgspec.Raw(body), tag=tag(key, *bound, body).hex() if key else "")
    return msgspec.json.encode(sealed)


def unseal(data: bytes, key: bytes | None, *bound: bytes) -> bytes:
    """The record's bytes in `data`, checked against its tag when there is a key. Raises
    ForgedRecordError for a tag that does not verify, msgspec.DecodeError for what is not a
    sealed record."""
    sealed = msgspec.json.decode(data, type=SealedRecord)
    body = bytes(sealed.record)
    if key is not None:
        try:
            expected = bytes.fromhex(sealed.tag)
        except ValueError:
            expected = b""
        if not is_valid_tag(key, expected, *bound, body):
            raise ForgedRecordError("no valid tag for this cluster secret")
    return body
