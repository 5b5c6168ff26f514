"""HMAC-SHA256 tags on frames that cross nodes.

Links inside one node are ipc:// sockets in a 0700 directory, so only this user reaches
them. Links between nodes are tcp://, which anyone on the network reaches: each frame there
is `tag (32 bytes) + payload`, the tag being HMAC-SHA256 of the payload under the cluster
secret (--cluster-secret-file). A frame whose tag does not match is dropped and counted,
never decoded. The tag gives integrity and authenticity, not secrecy: frames are not
encrypted.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets

logger = logging.getLogger(__name__)

TAG_BYTES = 32
SECRET_BYTES = 32


class FrameSigner:
    """Signs and verifies frames with one secret; `rejected` counts frames refused."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        self._secret = secret
        self.rejected = 0

    def tag(self, payload: bytes) -> bytes:
        return hmac.new(self._secret, payload, hashlib.sha256).digest()

    def sign(self, payload: bytes) -> bytes:
        return self.tag(payload) + payload

    def verify(self, frame: bytes, socket_name: str) -> bytes | None:
        """The payload of a correctly signed frame, else None (counted)."""
        if len(frame) < TAG_BYTES:
            self.count_rejected(socket_name, f"{len(frame)} bytes, shorter than a tag")
            return None
        tag, payload = frame[:TAG_BYTES], frame[TAG_BYTES:]
        if not hmac.compare_digest(tag, self.tag(payload)):
            self.count_rejected(socket_name, "bad HMAC tag")
            return None
        return payload

    def count_rejected(self, socket_name: str, why: str) -> None:
        self.rejected += 1
        logger.warning("rejected a frame on %s: %s (%d rejected so far)", socket_name, why, self.rejected)


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def read_secret_file(path: str) -> bytes:
    """The secret as written by `write_secret_file`: hex text, whitespace ignored."""
    with open(path) as f:
        text = f.read().strip()
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{path} does not hold a hex cluster secret") from None


def write_secret_file(path: str, secret: bytes) -> None:
    """Writes the secret readable by this user only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
