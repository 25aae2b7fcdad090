"""The gateway's error type and its rendering in OpenAI's error shape."""

from __future__ import annotations

import json
from collections.abc import Mapping

from aiohttp import web

from blockq.frontdoors.gateway.openai_responses import error_body


class GatewayError(Exception):
    """An HTTP error to answer with: status, OpenAI ``type``/``param``/``code``, headers,
    and whether to close the connection after it."""

    def __init__(self, status: int, message: str, error_type: str, *, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None,
                 close_connection: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        # For a request whose body was not read to its end: the connection cannot carry
        # another request, so the answer says ``Connection: close``.
        self.close_connection = close_connection

    def to_response(self) -> web.Response:
        body = error_body(self.message, self.error_type, self.param, self.code)
        response = web.Response(status=self.status, text=json.dumps(body), content_type="application/json",
                                headers=self.headers)
        if self.close_connection:
            response.force_close()
        return response
