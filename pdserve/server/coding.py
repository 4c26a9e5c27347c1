"""Request bodies sent with a `Content-Encoding`: gzip and deflate are decoded as the
body arrives, and the body-size limit holds for the decoded bytes.

A gzip bomb (a few MB that inflate to gigabytes) is refused with 413 once its decoded
bytes pass the limit: each chunk is inflated with the room left as its cap, so no more
than the limit is ever held, whatever the ratio. Any other coding is refused with 415
naming it; `identity` is a plain body. Gzip bodies may hold several members (as
`gzip.decompress` reads them); deflate is the zlib format (RFC 9110).
"""

from __future__ import annotations

import zlib

_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_ALIASES = {"x-gzip": "gzip"}  # RFC 9110 8.4.1.3: a recipient treats x-gzip as gzip


class CodingError(Exception):
    """A body refused for its coding: `status` and the error message to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class BodyDecoder:
    """One body's decoding, fed chunk by chunk; refuses it past `limit` decoded bytes."""

    def __init__(self, coding: str, limit: int) -> None:
        self.coding = coding
        self.limit = limit
        self.size = 0  # decoded bytes so far
        self._z = zlib.decompressobj(_WBITS[coding])

    def feed(self, data: bytes) -> bytes:
        """The decoded bytes of the next chunk; CodingError (413 past the limit, 400 for
        bytes that are not this coding)."""
        out: list[bytes] = []
        while data:
            if self._z.eof:  # another gzip member follows; anything else is garbage
                if self.coding != "gzip":
                    raise self._invalid()
                self._z = zlib.decompressobj(_WBITS[self.coding])
            try:
                part = self._z.decompress(data, self.limit - self.size + 1)
            except zlib.error:
                raise self._invalid() from None
            self.size += len(part)
            if self.size > self.limit:
                raise CodingError(413, self._too_large())
            out.append(part)
            data = self._z.unconsumed_tail or self._z.unused_data
        return b"".join(out)

    def end(self) -> None:
        """The body is complete: CodingError (400) if its coded stream is not."""
        if not self._z.eof:
            raise self._invalid()

    def _too_large(self) -> str:
        return (
            f"request body is larger than the limit of {self.limit} bytes once decoded "
            f"(Content-Encoding: {self.coding})"
        )

    def _invalid(self) -> CodingError:
        message = f"request body is not valid {self.coding} data (Content-Encoding: {self.coding})"
        return CodingError(400, message)


def decoder_for(content_encoding: bytes | None, limit: int) -> BodyDecoder | None:
    """The decoder for a `Content-Encoding` header's value; None for a plain body;
    CodingError (415) for a coding that is not decoded here (stacked codings included)."""
    if content_encoding is None:
        return None
    text = content_encoding.decode("latin-1")
    codings = [c.strip().lower() for c in text.split(",")]
    codings = [_ALIASES.get(c, c) for c in codings if c not in ("", "identity")]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in _WBITS:
        raise CodingError(
            415,
            f"Content-Encoding {text.strip()!r} is not supported; send the body plain, as gzip "
            "or as deflate",
        )
    return BodyDecoder(codings[0], limit)
