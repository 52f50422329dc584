"""How many bytes a request body may have, route by route: refused before it is read.

Parsing JSON and validating it hold the GIL, in a thread or not, so a body costs every other
client time on the event loop in proportion to its size: about 50 ms a MiB of token ids
here (`json.loads` and pydantic together; benchmarks/soak.py sends such bodies while it
times /health). One flat limit would have to be large enough for the largest legitimate
body, so each route has the limit it needs instead:

- the routes that take prompts: one prompt that fills the model's context, as token ids or
  as text (BYTES_PER_TOKEN), or `--max-body-mb` (1 MiB by default) for batches of shorter
  ones, whichever is larger;
- `/detokenize`: a context's worth of token ids;
- `/update_weights_from_distributed`: the names, dtypes and shapes of every tensor;
- the upload routes: none here (their handlers stream the body to a file, with caps of their
  own: api/http/uploads.py);
- everything else, which takes a few fields: SMALL.

A body over its limit is a 413 naming the limit, whether its Content-Length says so or its
bytes run past it; the loop never parses it.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quart_trio.wrappers.request import TrioRequest
from werkzeug.datastructures import Headers

from api.http.errors import APIError

SMALL = 64 * 2**10  # sampling fields with every list at its cap fit in it
# a token id is at most 8 bytes ("151642, "); text escaped as \u and four hex digits, 16
BYTES_PER_TOKEN = 16
DEFAULT_MAX_BODY = 2**20
PROMPT_ROUTES = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/generate", "/generate/", "/chat/", "/tokenize",
     "/v1/embeddings", "/encode"}
)  # fmt: skip
SPEC_LISTS = 2**20  # /update_weights_from_distributed names every tensor of the model
UNREAD_LIMIT = 128 * 2**20  # an upload received but not yet written to its file


@dataclass(frozen=True, slots=True)
class BodyBudget:
    """The byte limit of each route's body.

    Attributes:
        context: the served model's context, in tokens (asked per request: the model may
            still be loading when the server starts listening).
        max_body: the limit of a route that takes prompts, at least (`--max-body-mb`).
        uploads: routes whose handlers stream the body to a file.
        api_key: an upload without it keeps the usual limit (it is answered 401 unread).
    """

    context: Callable[[], int]
    max_body: int = DEFAULT_MAX_BODY
    uploads: frozenset[str] = frozenset()
    api_key: str | None = None

    def limit(self, path: str) -> int:
        one_prompt = SMALL + BYTES_PER_TOKEN * self.context()
        if path in PROMPT_ROUTES:
            return max(self.max_body, one_prompt)
        if path == "/detokenize":
            return one_prompt
        if path == "/update_weights_from_distributed":
            return SPEC_LISTS
        return SMALL

    def too_large(self, path: str) -> APIError:
        limit = self.limit(path)
        why = (
            f"one prompt of the model's {self.context()}-token context, or --max-body-mb for "
            "batches: send fewer prompts per request"
            if path in PROMPT_ROUTES
            else "what the route's fields need"
        )
        return APIError(
            413,
            f"the body is over {limit} bytes, the limit of {path} ({why})",
            code="body_too_large",
        )

    def request_class(self) -> type[TrioRequest]:
        """Quart's request, with each route's limit instead of one for all."""
        budget = self

        class BudgetedRequest(TrioRequest):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                if self.path in budget.uploads:
                    # only the bytes received and not yet written to the file count
                    authorized = budget.api_key is None or bearer_is(self.headers, budget.api_key)
                    self.body = self.body_class(None, UNREAD_LIMIT if authorized else SMALL)
                else:
                    self.body = self.body_class(self.content_length, budget.limit(self.path))

        return BudgetedRequest


def bearer_is(headers: Headers, key: str) -> bool:
    """The request carries `key` as `Authorization: Bearer <key>` (clients differ in their
    spaces); in constant time: how long a wrong key takes must not tell how much was right."""
    scheme, _, given = headers.get("Authorization", "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())
