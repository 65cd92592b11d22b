"""A deadline on a request's headers, which uvicorn lacks.

uvicorn (h11) waits forever for the headers of a request: a client that connects and sends
nothing, or half a request line, holds a connection and its file descriptor until it leaves, so a
few hundred such clients exhaust the server (its keep-alive timeout runs only between requests).
This protocol starts a timer whenever the server waits for a request's headers (a new connection,
or a kept-alive one whose next request has begun to arrive) and, if they are not complete by
then, answers 408 and closes the connection. The request body's own deadline is the API server's
(--request-body-timeout).
"""
from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_TIMEOUT_BODY = b"the request headers did not arrive in time"
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))

def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a `timeout_s` deadline on every request's headers (pass the
    class as uvicorn.Config(http=...))."""
    if not timeout_s > 0:  # NaN too
        raise ValueError(f"the request-header timeout must be > 0 seconds, got {timeout_s}")

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and data:
                self._arm()  # the next request on a kept-alive connection has begun
            else:
                self._disarm()  # its headers are in: the body has its own deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(_TIMEOUT_RESPONSE)
                self.transport.close()

    return HeaderTimeoutProtocol
