"""A completions prompt of token ids parsed from the JSON body straight into u32s (json_ids.c),
never one Python int per id: `split_prompt` takes the body's `prompt` array out (the rest is
decoded as usual) and `U32TokenIds` stands for the list of ids wherever one is read. Without a
C compiler, or for any body not of the plainest shape, the caller decodes the body the general
way, so every answer (and every error) is the one that decode gives."""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

from tandem.protocols.openai import ParsedTokenIds

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("json_ids.c")
_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11")
_IS_LE = sys.byteorder == "little"
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
PLACEHOLDER = b"[0]"  # what the prompt array is replaced with before the rest is decoded
_ZERO = (0,)
byref = ctypes.byref


class U32TokenIds(ParsedTokenIds):
    """Token ids held as one u32 array, read like the `list[int]` they stand for (len, index,
    slice → list, iteration, ==, + → list). `u32_le` is the request plane's buffer of them;
    `tolist()` makes (once) the list for the rare reader that needs one, e.g. echo."""

    __slots__ = ("_list", "ids", "max_id")

    def __init__(self, ids: array[int], max_id: int) -> None:
        self.ids = ids  # typecode "I", host order
        self.max_id = max_id
        self._list: list[int] | None = None

    @property
    def u32_le(self) -> bytes:
        if _IS_LE:
            return self.ids.tobytes()
        swapped = array("I", self.ids)
        swapped.byteswap()
        return swapped.tobytes()

    def tolist(self) -> list[int]:
        if self._list is None:
            self._list = self.ids.tolist()
        return self._list

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self.ids[index].tolist()
        return self.ids[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __add__(self, other: Sequence[int]) -> list[int]:
        return [*self.tolist(), *other]

    def __radd__(self, other: Sequence[int]) -> list[int]:
        return [*other, *self.tolist()]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, U32TokenIds):
            return self.ids == other.ids
        if isinstance(other, list | tuple):
            return len(other) == len(self.ids) and self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable like the list it stands for

    def __repr__(self) -> str:
        return f"U32TokenIds(<{len(self.ids)} ids>)"


def split_prompt(body: bytes) -> tuple[bytes, U32TokenIds | list[U32TokenIds]] | None:
    """(the body with its prompt array replaced by PLACEHOLDER, the prompt) when the body's
    top-level "prompt" is a flat array of plain integers < 2^32 (the prompt: U32TokenIds) or an
    array of such arrays (a list of them); None otherwise (no compiler, another shape, or a
    malformed element: the general decode then answers)."""
    lib = _library()
    if lib is None:
        return None
    start, end, count = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
    kind = lib.ji_find_prompt(body, len(body), byref(start), byref(end), byref(count))
    if not kind:
        return None
    s, e, n = start.value, end.value, count.value
    rest = body[:s] + PLACEHOLDER + body[e:]
    if kind == 1:
        ids = _parse(lib, body, s, e, n)
        return None if ids is None else (rest, ids)
    spans = array("q", _ZERO) * (3 * n)  # per prompt: start, end, number of ids
    if lib.ji_batch_spans(body, s, e, spans.buffer_info()[0], n) != n:
        return None
    prompts = []
    for k in range(0, 3 * n, 3):
        if (ids := _parse(lib, body, spans[k], spans[k + 1], spans[k + 2])) is None:
            return None
        prompts.append(ids)
    return rest, prompts


def _parse(lib: ctypes.CDLL, body: bytes, start: int, end: int, n: int) -> U32TokenIds | None:
    ids = array("I", _ZERO) * n
    top = ctypes.c_uint32()
    if lib.ji_parse_u32(body, start, end, ids.buffer_info()[0], n, byref(top)) != n:
        return None
    return U32TokenIds(ids, top.value)


def _library() -> ctypes.CDLL | None:
    """json_ids.c compiled once per process (cached on disk by source and flags); None with
    one log line when there is no compiler or the build fails."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            _lib = _load()
            _tried = True
    return _lib


def _load() -> ctypes.CDLL | None:
    from tandem.cbuild import CBuildError, compile_c

    try:
        lib = ctypes.CDLL(str(compile_c(_SOURCE, "json_ids", _FLAGS)))
    except (CBuildError, OSError) as exc:
        log.warning("token-id prompts take the general JSON decode: %s", exc)
        return None
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.ji_find_prompt.argtypes = [ctypes.c_char_p, i64, p, p, p]
    lib.ji_find_prompt.restype = ctypes.c_int
    lib.ji_parse_u32.argtypes = [ctypes.c_char_p, i64, i64, p, i64, p]
    lib.ji_parse_u32.restype = i64
    lib.ji_batch_spans.argtypes = [ctypes.c_char_p, i64, i64, p, i64]
    lib.ji_batch_spans.restype = i64
    return lib


def load_library() -> bool:
    """Build and load the parser now (at startup, not on the first request); whether it
    loaded."""
    return _library() is not None
