"""Bootstrap for a replica job on an image that does not contain composer-cloud.

Run as ``python -c "<this file's source>" REPLICA_ARGV...``. It needs only the
standard library, ``pip`` and, for object stores other than ``file://``, an
fsspec backend (installed on the fly if missing). It:

1. reads the wheel the launcher staged in the run's store
   (``$COMPOSER_CLOUD_WHEEL_URI``: a URI like ``s3://bucket/prefix/run/executor/wheel/<sha>/<name>.whl``),
2. verifies the store's framing (magic, crc32, length) and the wheel's sha256
   (``$COMPOSER_CLOUD_WHEEL_SHA256``) -- a damaged or swapped wheel is never installed,
3. ``pip install``s it (plus ``$COMPOSER_CLOUD_PIP_ARGS``, e.g. ``--no-index``) into
   the interpreter running this script,
4. ``exec``s REPLICA_ARGV, so the replica's exit code and signals are the job's.

Failures of steps 1-3 exit with :data:`BOOTSTRAP_EXIT_CODE` and a line starting
with ``composer-cloud bootstrap:`` that says what to fix. Nothing here prints
environment values: secrets arrive as environment variables and stay there.

Store credentials come from the environment (``AWS_*`` job secrets for S3);
non-secret store options from ``$COMPOSER_CLOUD_STORE_OPTIONS`` (JSON). A
``file://`` wheel URI only works when the job shares the launcher's filesystem
(the local Jobs server used by the tests).

Keep this file self-contained: it is shipped as the job's command line.
"""

import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import zlib

BOOTSTRAP_EXIT_CODE = 97
_MAGIC = b"CCO1"
_HEADER = struct.Struct("<4sIQ")  # must match composer_cloud.rendezvous.store
_FS_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def _fail(message):
    sys.stderr.write("composer-cloud bootstrap: %s\n" % message)
    sys.stderr.flush()
    sys.exit(BOOTSTRAP_EXIT_CODE)


def _pip(args):
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input"] + args
    return subprocess.call(cmd)


def _read(uri):
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    if scheme == "file":
        path = uri.split("://", 1)[1] if "://" in uri else uri
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            _fail("cannot read %s (%s). A file:// store only works when the job shares the launcher's "
                  "filesystem; use an s3:// store for cloud jobs." % (uri, exc))
    options = json.loads(os.environ.get("COMPOSER_CLOUD_STORE_OPTIONS") or "{}")
    try:
        import fsspec  # noqa: F401
        if scheme in _FS_PACKAGES:
            __import__(_FS_PACKAGES[scheme])
    except ImportError:
        wanted = ["fsspec"] + ([_FS_PACKAGES[scheme]] if scheme in _FS_PACKAGES else [])
        if _pip(["--quiet"] + wanted) != 0:
            _fail("could not pip install %s to read %s" % (" ".join(wanted), uri))
    import fsspec

    if scheme in ("s3", "s3a"):
        endpoint = options.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
            "AWS_ENDPOINT_URL")
        if endpoint:
            options.setdefault("client_kwargs", {})["endpoint_url"] = endpoint
    try:
        with fsspec.open(uri, "rb", **options) as f:
            return f.read()
    except Exception as exc:  # noqa: BLE001 - reported with the fix
        _fail("cannot read %s (%s: %s). Check that the job has the store's credentials as secrets "
              "(e.g. AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL)." % (uri, type(exc).__name__, exc))


def _unframe(uri, data):
    if len(data) < _HEADER.size:
        _fail("%s is truncated (%d bytes)" % (uri, len(data)))
    magic, crc, length = _HEADER.unpack_from(data)
    payload = data[_HEADER.size:]
    if magic != _MAGIC or len(payload) != length or zlib.crc32(payload) != crc:
        _fail("%s is corrupt (bad magic, length or crc32); relaunch to stage the wheel again" % uri)
    return payload


def main(argv):
    if not argv:
        _fail("no replica command given after the bootstrap")
    uri = os.environ.get("COMPOSER_CLOUD_WHEEL_URI")
    want = os.environ.get("COMPOSER_CLOUD_WHEEL_SHA256")
    if not uri or not want:
        _fail("COMPOSER_CLOUD_WHEEL_URI and COMPOSER_CLOUD_WHEEL_SHA256 must be set by the launcher")
    wheel = _unframe(uri, _read(uri))
    got = hashlib.sha256(wheel).hexdigest()
    if got != want:
        _fail("%s has sha256 %s, expected %s; relaunch to stage the wheel again" % (uri, got, want))
    tmp = tempfile.mkdtemp(prefix="composer-cloud-wheel-")
    path = os.path.join(tmp, uri.rstrip("/").rsplit("/", 1)[-1])  # pip needs the wheel's own file name
    with open(path, "wb") as f:
        f.write(wheel)
    extra = os.environ.get("COMPOSER_CLOUD_PIP_ARGS", "").split()
    print("composer-cloud bootstrap: installing %s (sha256 %s)" % (os.path.basename(path), got[:12]), flush=True)
    if _pip(["--quiet"] + extra + [path]) != 0:
        _fail("pip install of %s failed (see the lines above)" % os.path.basename(path))
    # Run the replica with the interpreter the wheel was installed into.
    if argv[0] in ("python", "python3"):
        argv = [sys.executable] + argv[1:]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
