"""The pipeline's own error: a request it cannot run, for a reason the client can fix.

The pipeline knows nothing of HTTP; the edge (``http.routes.serving.request_scope``)
answers it as a 400 in OpenAI's envelope.
"""

from __future__ import annotations


class InvalidRequest(Exception):
    """``param`` names the request field to blame; ``code`` is a machine-readable reason
    (``context_length_exceeded``)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
