"""The `/v1/rerank` and `/v1/score` requests and responses, and the checks on their inputs'
form.

Shapes: rerank is the Jina / Cohere shape vLLM serves (`query`, `documents` as strings or
`{"text": ...}` objects, `top_n`, `return_documents`; results `{index, relevance_score,
document}` best first); score is vLLM's (`text_1` / `text_2`, each a string or a list, paired
1:1, 1:N or N:N; `data` `{index, object: "score", score}` in pair order). Value checks that
need the model (vocabulary, context length) are in `tandem.frontend.api.embedder`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from tandem.errors import InvalidRequest
from tandem.protocols.openai import Unsupported, check_unsupported, show_value
from tandem.protocols.openai_embedding import MAX_INPUTS

MAX_REQUEST_ID_CHARS = 128  # the X-Request-ID rule
_REQUEST_ID = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces
_NO_ACTIVATION = (
    "the score is the cosine similarity of the model's pooled embeddings, not a classifier's "
    "logit: there is no activation to apply"
)
_NO_TEMPLATE = (
    "the embedding model takes each text as it is: no score template to give an instruction to"
)
_SHARED_UNSUPPORTED = {
    "priority": Unsupported((None, 0), "embedding calls have one priority here"),
    "use_activation": Unsupported((None, False), _NO_ACTIVATION),
    "softmax": Unsupported((None, False), _NO_ACTIVATION),  # vLLM before use_activation
    "activation": Unsupported((None, False), _NO_ACTIVATION),  # vLLM before use_activation
    "mm_processor_kwargs": Unsupported((None, {}), "inputs are text only"),
    "instruction": Unsupported((None,), _NO_TEMPLATE),
    "chat_template_kwargs": Unsupported((None, {}), _NO_TEMPLATE),
    "padding": Unsupported(
        (None, "do_not_pad"), "the pooled mean is over a text's own tokens: never padded"
    ),
}
UNSUPPORTED_RERANK = {
    **_SHARED_UNSUPPORTED,
    "rank_fields": Unsupported((None,), 'documents are text (strings or {"text": ...})'),
    "max_chunks_per_doc": Unsupported(
        (None,), "a document is embedded whole (or cut by max_tokens_per_doc), never chunked"
    ),
    "relevant_spans": Unsupported(
        (None, {"mode": "disabled"}), "a document gets one score (a cosine), no spans"
    ),
}
UNSUPPORTED_SCORE = _SHARED_UNSUPPORTED
# score's pairs of input fields, vLLM's names for (first, second); exactly one pair per request
SCORE_FIELD_PAIRS = (
    ("text_1", "text_2"),
    ("data_1", "data_2"),
    ("queries", "documents"),
    ("queries", "items"),
)
_SCORE_FIELDS = tuple(dict.fromkeys(name for pair in SCORE_FIELD_PAIRS for name in pair))


class ScoringOptions(msgspec.Struct, kw_only=True):
    """What rerank and score requests share: the answer's id, how each text is cut, fields
    accepted with no effect, and vLLM's fields refused by name (`_SHARED_UNSUPPORTED`)."""

    user: str | None = None  # accepted; tandem keeps no per-user state
    request_id: str | None = None  # the answer's id is "<rerank|score>-<request_id>"
    cache_salt: str | None = None  # accepted: an embedding never reads or fills the prefix cache
    max_tokens_per_query: int = 0  # each query (first text) cut to its first N tokens; 0: uncut
    max_tokens_per_doc: int = 0  # each document (second text) cut to its first N tokens; 0: uncut
    truncate_prompt_tokens: int | None = None  # each text cut to N tokens (-1: the context)
    truncation_side: str | None = None  # which end truncate_prompt_tokens cuts; unset: "left"
    priority: Any = None
    use_activation: Any = None
    softmax: Any = None
    activation: Any = None
    mm_processor_kwargs: Any = None
    instruction: Any = None
    chat_template_kwargs: Any = None
    padding: Any = None


class RerankRequest(ScoringOptions, kw_only=True):
    """Every field of vLLM's, Jina's and Cohere's (v1, v2) rerank requests: honoured, or
    refused by name (`UNSUPPORTED_RERANK`)."""

    model: str
    query: str
    # a string, or a list of strings or {"text": str}; checked by `rerank_documents`
    documents: str | list[Any]
    top_n: int | None = None  # None or 0 (vLLM's default): every document
    return_documents: bool = True  # Jina's default (vLLM always returns them)
    rank_fields: Any = None  # Cohere v1
    max_chunks_per_doc: Any = None  # Cohere v1
    relevant_spans: Any = None  # Cohere v2


class ScoreRequest(ScoringOptions, kw_only=True):
    """vLLM's score request; its input fields under any of vLLM's names
    (`SCORE_FIELD_PAIRS`), each a string or a list of strings."""

    model: str
    text_1: str | list[Any] | None = None
    text_2: str | list[Any] | None = None
    data_1: str | list[Any] | None = None
    data_2: str | list[Any] | None = None
    queries: str | list[Any] | None = None
    documents: str | list[Any] | None = None
    items: str | list[Any] | None = None


def validate_rerank(req: RerankRequest) -> tuple[list[str], list[str]]:
    """The texts to embed (the query first, then each document) and each one's `param` name
    for errors. Raises InvalidRequest naming the field."""
    _check_model(req.model)
    check_unsupported(req, UNSUPPORTED_RERANK)
    check_cuts(req)
    if req.top_n is not None and req.top_n < 0:
        raise InvalidRequest(
            f"top_n={req.top_n} is invalid; expected an integer >= 1 (0 or unset: every document)",
            param="top_n",
        )
    _check_text(req.query, "query")
    documents = rerank_documents(req.documents)
    return [req.query, *documents], ["query", *(f"documents[{i}]" for i in range(len(documents)))]


def rerank_documents(value: str | list[Any]) -> list[str]:
    """Each document's text: a non-empty string, or an object whose `text` is one (a lone
    string is one document, as vLLM takes it)."""
    if isinstance(value, str):
        value = [value]
    if not value:
        raise InvalidRequest(
            "documents is an empty list; expected at least one document", param="documents"
        )
    if len(value) > MAX_INPUTS - 1:  # the query and the documents go in one embed call
        raise InvalidRequest(
            f"documents has {len(value)} items; at most {MAX_INPUTS - 1} per request (split it)",
            param="documents",
        )
    texts = []
    for i, item in enumerate(value):
        text = item.get("text") if isinstance(item, dict) else item
        if not isinstance(text, str) or not text:
            raise InvalidRequest(
                f"documents[{i}]={show_value(item)} is invalid; expected a non-empty string or "
                'an object {"text": "<non-empty string>"}',
                param=f"documents[{i}]",
            )
        texts.append(text)
    return texts


class ScorePairs(msgspec.Struct, kw_only=True, frozen=True):
    """A score request's inputs: `firsts` (one, broadcast, or one per second) and `seconds`,
    with the names of the fields they came in."""

    firsts: list[str]
    seconds: list[str]
    names: tuple[str, str]

    @property
    def num_pairs(self) -> int:
        return len(self.seconds)

    def params(self) -> list[str]:
        """Each embedded input's `param` name, firsts then seconds."""
        first, second = self.names
        return [*_item_params(first, self.firsts), *_item_params(second, self.seconds)]


def validate_score(req: ScoreRequest) -> ScorePairs:
    """The pairs to score; raises InvalidRequest naming the field."""
    _check_model(req.model)
    check_unsupported(req, UNSUPPORTED_SCORE)
    check_cuts(req)
    names = [n for n in _SCORE_FIELDS if getattr(req, n) is not None]
    pair = next((p for p in SCORE_FIELD_PAIRS if set(p) == set(names)), None)
    if pair is None:
        pairs = ", ".join(f"{a}/{b}" for a, b in SCORE_FIELD_PAIRS)
        raise InvalidRequest(
            f"score needs exactly one pair of inputs, got {', '.join(names) or 'none'}; "
            f"expected one of: {pairs}",
            param=_missing_field(names),
        )
    first, second = pair
    firsts = _score_texts(getattr(req, first), first)
    seconds = _score_texts(getattr(req, second), second)
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise InvalidRequest(
            f"{first} has {len(firsts)} items and {second} {len(seconds)}; expected 1:1, 1:N "
            f"or N:N (one {first} for every {second}, or a single {first})",
            param=second,
        )
    if len(firsts) + len(seconds) > MAX_INPUTS:  # every input goes in one embed call
        raise InvalidRequest(
            f"{first} and {second} have {len(firsts) + len(seconds)} texts in all; at most "
            f"{MAX_INPUTS} per request (split it)",
            param=second,
        )
    return ScorePairs(firsts=firsts, seconds=seconds, names=(first, second))


def _missing_field(names: list[str]) -> str:
    """The field to name when `names` is not one pair: the partner of a lone first field."""
    partner = next((b for a, b in SCORE_FIELD_PAIRS if names == [a]), None)
    return partner or (names[-1] if names else "text_1")


def _score_texts(value: str | list[Any], name: str) -> list[str]:
    if isinstance(value, str):
        _check_text(value, name)
        return [value]
    if not value:
        raise InvalidRequest(f"{name} is an empty list; expected at least one text", param=name)
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise InvalidRequest(
                f"{name}[{i}]={show_value(item)} is invalid; expected a non-empty string "
                "(multimodal inputs are not offered)",
                param=f"{name}[{i}]",
            )
    return list(value)


def _item_params(name: str, items: list[str]) -> list[str]:
    return [name] if len(items) == 1 else [f"{name}[{i}]" for i in range(len(items))]


def _check_model(model: str) -> None:
    if not model:
        raise InvalidRequest("model='' is invalid; expected a non-empty model name", param="model")


def check_cuts(req: RerankRequest | ScoreRequest) -> None:
    """The fields that cut texts, and `request_id`; raises InvalidRequest naming the field."""
    value = req.truncate_prompt_tokens
    if value is not None and value != -1 and value < 1:
        raise InvalidRequest(
            f"truncate_prompt_tokens={value} is invalid; expected -1 (the model's context "
            "length) or an integer >= 1 (each text keeps N tokens)",
            param="truncate_prompt_tokens",
        )
    if req.truncation_side not in (None, "left", "right"):
        raise InvalidRequest(
            f"truncation_side={show_value(req.truncation_side)} is invalid; expected left "
            "(keep the last tokens) or right (keep the first)",
            param="truncation_side",
        )
    for name in ("max_tokens_per_query", "max_tokens_per_doc"):
        if getattr(req, name) < 0:
            raise InvalidRequest(
                f"{name}={getattr(req, name)} is invalid; expected an integer >= 0 (0: uncut)",
                param=name,
            )
    rid = req.request_id
    if rid is not None and (len(rid) > MAX_REQUEST_ID_CHARS or not _REQUEST_ID.fullmatch(rid)):
        raise InvalidRequest(
            f"request_id={show_value(rid)} is invalid; expected 1 to {MAX_REQUEST_ID_CHARS} "
            "printable ASCII characters without spaces",
            param="request_id",
        )


def _check_text(text: str, param: str) -> None:
    if not text:
        raise InvalidRequest(f"{param} is an empty string; expected text", param=param)


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A response body: every field documented (decoding a real body checks that)."""


class RerankDocument(_Body):
    text: str


class RerankResult(_Body, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None  # left out with return_documents: false


class RerankUsage(_Body):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(_Body):
    """Results best first (ties: the earlier document first), at most `top_n`."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreData(_Body):
    index: int
    score: float
    object: Literal["score"] = "score"


class ScoreUsage(_Body):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(_Body):
    """One score per pair, in pair order."""

    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage
    object: Literal["list"] = "list"
