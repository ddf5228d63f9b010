"""Text prompts for chat endpoints, which take no token ids.

`tokens_to_text` maps each token id to one common English word (most are a single token in
BPE vocabularies with the leading space), so a prompt of n ids becomes roughly n tokens and
prompts sharing a token-id prefix share a text prefix. Lengths are approximate; use
`/v1/completions` with token-id prompts for exact lengths.
"""

from __future__ import annotations

_WORDS_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their has been will more "
    "when would who so if out up no can its time only new some about could these two may "
    "first then do any like my now over such our man me even most made after also did "
    "many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three "
    "place house light water side city small home hand part high left large next early "
    "young point often world open room word car book line name game door food tree bird "
    "fish road hill ship wind rain snow sun "
)
WORDS = tuple(_WORDS_TEXT.split())


def tokens_to_text(token_ids: list[int]) -> str:
    words = WORDS
    n = len(words)
    return " ".join(words[t % n] for t in token_ids)
