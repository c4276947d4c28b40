"""The frame around every stored object: ``magic | crc32 | length | payload``, optionally HMAC-signed.

Unsigned frames (``CCO1``) carry a 16-byte little-endian header; signed frames
(``CCS1``) add an HMAC-SHA256 over the object's key and its payload, keyed by
the run's signing key: :func:`derive_signing_key` of the secret
``COMPOSER_CLOUD_RUN_KEY``, the run id and the run's salt (``run_salt``, 16
random bytes ``launch`` writes once into ``spec.json``). So a signature binds
an object to one run (its id *and* its launch: two runs given one key, even
under one run id in two stores, sign with unrelated keys) and to one key path
(its round, attempt, rank, slot, ... are in the path), and a reader with a
signing key accepts only frames whose signature verifies for the key it asked
for: an object copied to another run, round, attempt or key is rejected. The HF Jobs bootstrap keeps its
own copy of :func:`unframe` (it runs before composer-cloud is installed);
``tests/test_store.py`` pins the two to the same format.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import zlib

from composer_cloud import env
from composer_cloud.errors import ChecksumMismatch, RunKeyError, SignatureMismatch

MAGIC = b"CCO1"
_HEADER = struct.Struct("<4sIQ")  # magic, crc32(payload), len(payload)
HEADER_BYTES = _HEADER.size
SIGNED_MAGIC = b"CCS1"
_SIGNED_HEADER = struct.Struct("<4sIQ32s")  # magic, crc32(payload), len(payload), hmac-sha256
SIGNED_HEADER_BYTES = _SIGNED_HEADER.size
_MAC_DOMAIN = b"composer-cloud/object/v2\0"
_KDF_INFO = b"composer-cloud/run/v2\0"
#: Length of a run's salt (``spec.run_salt``, hex in the spec), in bytes.
RUN_SALT_BYTES = 16
#: Shortest accepted run key, in bytes (a shorter secret is guessable offline from one signed object).
MIN_SIGNING_KEY_BYTES = 16


def _mac(signing_key: bytes, key: str, payload: memoryview) -> bytes:
    h = hmac.new(signing_key, _MAC_DOMAIN, hashlib.sha256)
    h.update(key.encode())
    h.update(b"\0")
    h.update(payload)
    return h.digest()


def frame(payload: bytes | bytearray | memoryview, *, key: str | None = None,
          signing_key: bytes | None = None) -> bytes:
    """Prefix ``payload`` with the verification header (signed over ``key`` + payload with ``signing_key``)."""
    view = memoryview(payload)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B") if view.c_contiguous else memoryview(bytes(view))
    if signing_key is None:
        return _HEADER.pack(MAGIC, zlib.crc32(view), view.nbytes) + bytes(view)
    if key is None:
        raise ValueError("frame(signing_key=...) needs the object's key: the signature covers it")
    return _SIGNED_HEADER.pack(SIGNED_MAGIC, zlib.crc32(view), view.nbytes, _mac(signing_key, key, view)) + bytes(view)


def unframe(key: str, data: bytes, *, signing_key: bytes | None = None) -> memoryview:
    """Verify and strip the header; raises :class:`ChecksumMismatch` (:class:`SignatureMismatch`).

    Without ``signing_key`` signed and unsigned frames are accepted (their
    crc32 is checked, the signature is not). With it, only a frame whose
    HMAC over ``key`` and the payload verifies is accepted.
    """
    if len(data) < HEADER_BYTES:
        raise ChecksumMismatch(key, f"truncated: {len(data)} bytes")
    magic = bytes(data[:4])
    if magic == SIGNED_MAGIC:
        if len(data) < SIGNED_HEADER_BYTES:
            raise ChecksumMismatch(key, f"truncated: {len(data)} bytes")
        _, crc, length, mac = _SIGNED_HEADER.unpack_from(data)
        payload = memoryview(data)[SIGNED_HEADER_BYTES:]
    elif magic == MAGIC:
        if signing_key is not None:
            raise SignatureMismatch(key, "unsigned, but this run requires signed objects")
        _, crc, length = _HEADER.unpack_from(data)
        mac = None
        payload = memoryview(data)[HEADER_BYTES:]
    else:
        raise ChecksumMismatch(key, "not a composer-cloud object")
    if payload.nbytes != length:
        raise ChecksumMismatch(key, f"length {payload.nbytes} != recorded {length}")
    if zlib.crc32(payload) != crc:
        raise ChecksumMismatch(key, "crc32 mismatch")
    if signing_key is not None and not hmac.compare_digest(mac, _mac(signing_key, key, payload)):
        raise SignatureMismatch(key, "HMAC mismatch: written without this run's key, or under another key name")
    return payload


def run_key_bytes(value: str) -> bytes:
    """The run key as HMAC key material (UTF-8 bytes of ``COMPOSER_CLOUD_RUN_KEY``).

    Raises :class:`~composer_cloud.errors.RunKeyError` (naming the variable,
    never echoing the value) if it is shorter than :data:`MIN_SIGNING_KEY_BYTES`.
    """
    key = value.encode()
    if len(key) < MIN_SIGNING_KEY_BYTES:
        raise RunKeyError(f"{env.RUN_KEY} is too short ({len(key)} bytes); use at least "
                          f"{MIN_SIGNING_KEY_BYTES} random bytes, e.g. `python -c 'import secrets; "
                          "print(secrets.token_hex(32))'`")
    return key


def is_signed(data: bytes | memoryview) -> bool:
    """Whether framed ``data`` carries a signature (its magic), without verifying anything."""
    return bytes(data[:4]) == SIGNED_MAGIC


def derive_signing_key(run_key: bytes, run_id: str, salt: str = "") -> bytes:
    """The per-run signing key: HKDF-SHA256 (RFC 5869) of ``run_key`` with the run's salt, for its run id.

    ``salt`` is the spec's ``run_salt`` (hex; ``""`` only for specs written without one, e.g. by tests): it is
    the HKDF salt, and ``run_id`` the HKDF info, so the key differs for every run and every launch even when
    one run key is given to many runs. A stdlib HKDF (one output block: 32 bytes), pinned to RFC 5869's test
    vectors in ``tests/test_store.py``.
    """
    try:
        salt_bytes = bytes.fromhex(salt)
    except ValueError:
        raise RunKeyError(f"run {run_id!r}: its run_salt is not hex; the spec was not written by launch") from None
    return hkdf_sha256(run_key, salt=salt_bytes, info=_KDF_INFO + run_id.encode())


def hkdf_sha256(ikm: bytes, *, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 (RFC 5869): extract with ``salt`` (empty: 32 zero bytes), expand to ``length`` bytes."""
    if not 0 < length <= 255 * 32:
        raise ValueError(f"hkdf_sha256(length=...) must be in 1..{255 * 32}, got {length}")
    prk = hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()
    out, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
    return out[:length]


def new_run_salt() -> str:
    """A fresh run salt (hex of :data:`RUN_SALT_BYTES` random bytes), written once into the run's spec."""
    return secrets.token_hex(RUN_SALT_BYTES)


__all__ = ["HEADER_BYTES", "MAGIC", "MIN_SIGNING_KEY_BYTES", "RUN_SALT_BYTES", "SIGNED_HEADER_BYTES",
           "SIGNED_MAGIC", "derive_signing_key", "frame", "hkdf_sha256", "is_signed", "new_run_salt", "run_key_bytes",
           "unframe"]
