"""Bootstrap for a replica job on an image that does not contain composer-cloud.

Run as ``python -c "<this file's source>" REPLICA_ARGV...``. It needs only the
standard library, ``pip`` (or ``uv``) and, for object stores other than
``file://``, an fsspec backend (installed on the fly if missing). It:

1. reads the wheel the launcher staged in the run's store
   (``$COMPOSER_CLOUD_WHEEL_URI``: a URI like ``s3://bucket/prefix/run/executor/wheel/<sha>/<name>.whl``),
2. verifies the store's framing (magic, crc32, length) and the wheel's sha256
   (``$COMPOSER_CLOUD_WHEEL_SHA256``) -- a damaged or swapped wheel is never
   installed, and a damaged store object fails the job even when the wheel is
   already installed,
3. installs it into the interpreter running this script with the pinned
   constraints the launcher embedded in :data:`CONSTRAINTS` (the text of
   ``composer_cloud/images/requirements.txt``, so every replica of a run gets the
   tested versions, whatever the image has), with ``uv pip`` when the image has
   ``uv`` and ``pip`` otherwise, plus ``$COMPOSER_CLOUD_PIP_ARGS`` (e.g.
   ``--no-index``); when this interpreter already has the wheel with the same
   sha256 (a restarted job in the same container), nothing is installed,
4. ``exec``s REPLICA_ARGV, so the replica's exit code and signals are the job's.

Failures of steps 1-3 exit with :data:`BOOTSTRAP_EXIT_CODE` and a line starting
with ``composer-cloud bootstrap:`` that says what to fix. Nothing here prints
environment values: secrets arrive as environment variables and stay there.

Store credentials come from the environment (``AWS_*`` job secrets for S3);
non-secret store options from ``$COMPOSER_CLOUD_STORE_OPTIONS`` (JSON). A
``file://`` wheel URI only works when the job shares the launcher's filesystem
(the local Jobs server used by the tests).

Keep this file self-contained and standard-library only: it is shipped as the
job's command line. Environment names are literals here; their one definition
is ``composer_cloud/env.py`` (keep them in step).
"""

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import zlib

BOOTSTRAP_EXIT_CODE = 97
# The frame of composer_cloud.storage.framing (tests/test_store.py pins the two): unsigned, and signed
# (a signed run's objects); the signature is not checked here: the wheel's sha256 comes from the launcher.
_MAGIC = b"CCO1"
_HEADER = struct.Struct("<4sIQ")
_SIGNED_MAGIC = b"CCS1"
_SIGNED_HEADER = struct.Struct("<4sIQ32s")
_FS_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
#: Pinned versions (requirements.txt text). The launcher replaces this line's value; None: unconstrained.
CONSTRAINTS = None
#: Written into the installed package after a successful install: the sha256 of the wheel it came from.
INSTALLED_MARKER = ".installed-wheel-sha256"


def _fail(message):
    sys.stderr.write("composer-cloud bootstrap: %s\n" % message)
    sys.stderr.flush()
    sys.exit(BOOTSTRAP_EXIT_CODE)


def _installer():
    """``uv pip`` when the image has uv (much faster for torch-sized wheels), else this interpreter's pip."""
    uv = shutil.which("uv")
    if uv:
        return [uv, "pip"], ["--python", sys.executable]
    return [sys.executable, "-m", "pip"], ["--disable-pip-version-check", "--no-input"]


def install_command(action, args, constraints_path=None, installer=None):
    """The ``pip``/``uv pip`` command line for ``action`` (install, uninstall) with the shipped constraints."""
    tool, common = installer or _installer()
    cmd = tool + [action] + common
    if action == "install" and constraints_path:
        cmd += ["-c", constraints_path]
    if action == "uninstall" and "-m" in tool:
        cmd += ["--yes"]  # pip asks for confirmation; uv does not
    return cmd + list(args)


def _constraints_file(tmp):
    if not CONSTRAINTS:
        print("composer-cloud bootstrap: no pinned constraints embedded; installing unconstrained", flush=True)
        return None
    path = os.path.join(tmp, "constraints.txt")
    with open(path, "w") as f:
        f.write(CONSTRAINTS)
    return path


def _pip(args, action="install"):
    if action == "install":
        extra = os.environ.get("COMPOSER_CLOUD_PIP_ARGS", "").split()
        cmd = install_command(action, extra + args, _constraints_file(tempfile.mkdtemp(prefix="composer-cloud-")))
    else:
        cmd = install_command(action, args)
    return subprocess.call(cmd)


def _package_dir():
    return os.path.join(sysconfig.get_paths()["purelib"], "composer_cloud")


def installed_sha256():
    """sha256 of the wheel composer_cloud was installed from by this bootstrap, or None."""
    pkg = _package_dir()
    if not os.path.isfile(os.path.join(pkg, "__init__.py")):
        return None
    try:
        with open(os.path.join(pkg, INSTALLED_MARKER)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _mark_installed(sha256):
    try:
        with open(os.path.join(_package_dir(), INSTALLED_MARKER), "w") as f:
            f.write(sha256 + "\n")
    except OSError as exc:  # a read-only site-packages only costs a reinstall on restart
        print("composer-cloud bootstrap: cannot record the installed wheel (%s)" % exc, flush=True)


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
    header = _SIGNED_HEADER if data[:4] == _SIGNED_MAGIC else _HEADER
    if len(data) < header.size:
        _fail("%s is truncated (%d bytes)" % (uri, len(data)))
    magic, crc, length = header.unpack_from(data)[:3]
    payload = data[header.size:]
    if magic not in (_MAGIC, _SIGNED_MAGIC) or len(payload) != length or zlib.crc32(payload) != crc:
        _fail("%s is corrupt (bad magic, length or crc32); relaunch to stage the wheel again" % uri)
    return payload


def _install_lock():
    """An exclusive lock on this interpreter's environment (None where none can be taken).

    Jobs that share one environment (the local Jobs server of the tests, a shared volume) would otherwise
    run pip into it at the same time and race on its files; with the lock, the second finds the wheel
    installed and installs nothing. The lock is released when this process execs or exits.
    """
    try:
        import fcntl

        f = open(os.path.join(sys.prefix, ".composer-cloud-install.lock"), "a")
    except (ImportError, OSError):
        return None
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


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
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    _held = _install_lock()  # held until exec: a second job sharing this environment then finds the wheel installed
    if installed_sha256() == got:
        print("composer-cloud bootstrap: %s (sha256 %s) is already installed; not reinstalling" % (name, got[:12]),
              flush=True)
    else:
        tmp = tempfile.mkdtemp(prefix="composer-cloud-wheel-")
        path = os.path.join(tmp, name)  # pip needs the wheel's own file name
        with open(path, "wb") as f:
            f.write(wheel)
        if installed_sha256() is not None:
            # Another build of the same version (pip would keep it as "already installed"): remove it first.
            _pip(["composer-cloud"], action="uninstall")
        print("composer-cloud bootstrap: installing %s (sha256 %s)" % (name, got[:12]), flush=True)
        if _pip([path]) != 0:
            _fail("installing %s failed (see the lines above)" % name)
        _mark_installed(got)
    # Run the replica with the interpreter the wheel was installed into.
    if argv[0] in ("python", "python3"):
        argv = [sys.executable] + argv[1:]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
