"""User code and files travel with a run: package at launch, verify and install in a replica."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import composer_cloud
from composer_cloud.registry import BadReference
from composer_cloud.errors import ChecksumMismatch
from composer_cloud.storage.store import Store
from composer_cloud.storage.layout import code_key
from composer_cloud.storage.records import CodeRef
from composer_cloud.archive import UnsafeArchive
from composer_cloud.replica.usercode import fetch_file, install_code
from composer_cloud.runs.packaging import (
    BundleTooLarge,
    CodeNotFound,
    UserCodeError,
    collect_code,
    pack_path,
    put_verified,
    upload_code,
)

REPO = Path(composer_cloud.__file__).resolve().parent.parent


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's folder: a task package, a sibling helper module it imports, data, and junk that must not travel."""
    proj = tmp_path / "proj"
    _write(proj / "my_tasks" / "__init__.py", """
        import json
        from pathlib import Path

        import my_helpers
        from my_tasks.sub import WORDS

        def make_task():
            rows = [json.loads(l) for l in (Path(__file__).parent / "prompts.jsonl").read_text().splitlines()]
            return {"task": "mine", "words": WORDS, "bonus": my_helpers.bonus(), "rows": rows}
        """)
    _write(proj / "my_tasks" / "sub.py", "WORDS = ['a', 'b']\n")
    _write(proj / "my_tasks" / "prompts.jsonl", '{"prompt": "p1"}\n{"prompt": "p2"}\n')
    _write(proj / "my_helpers.py", "import os\n\ndef bonus():\n    return 7\n")
    _write(proj / "data" / "pairs.jsonl", '{"chosen": "x", "rejected": "y"}\n')
    # must not travel: bytecode, hidden files (secrets), modules nothing imports
    _write(proj / "my_tasks" / "__pycache__" / "sub.cpython-311.pyc", "junk")
    _write(proj / "my_tasks" / "stale.pyc", "junk")
    _write(proj / "my_tasks" / ".env", "AWS_SECRET_ACCESS_KEY=nope\n")
    _write(proj / "unrelated.py", "raise SystemExit('never imported')\n")
    return proj


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An unrelated current directory, so nothing is found by accident through cwd."""
    d = tmp_path / "elsewhere"
    d.mkdir()
    monkeypatch.chdir(d)
    return d


def _run_in_fresh_process(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)  # composer_cloud only: the user's folder is not on the path
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


INSTALL_AND_LOAD = """
    import json, sys
    from pathlib import Path
    from composer_cloud.registry import load_object
    from composer_cloud.replica.usercode import install_code
    from composer_cloud.storage.records import CodeRef
    from composer_cloud.storage.store import Store

    try:
        import my_tasks
        sys.exit("my_tasks was importable before install_code")
    except ModuleNotFoundError:
        pass
    ref = CodeRef.from_json(json.loads(sys.argv[2]))
    where = install_code(Store(sys.argv[1]), ref, cache_dir=Path(sys.argv[3]))
    factory = load_object("my_tasks:make_task", setting="trainer.task")
    out = factory()
    out["dir"] = str(where)
    out["file"] = sys.modules["my_tasks"].__file__
    out["pairs"] = (where / "data" / "pairs.jsonl").read_text()
    print(json.dumps(out))
    """


def test_user_package_travels_to_a_fresh_process_in_another_directory(project, elsewhere, tmp_path, store_uri):
    bundle = collect_code({"trainer.task": "my_tasks:make_task", "trainer.reward": "json:loads",
                           "trainer.base": "composer_cloud.trainer.three_channel.tasks:PythonFunctionsTask",
                           "trainer.hint_source": "python-functions"},
                          include=["data/pairs.jsonl"], base_dir=project)
    assert bundle.modules == ("my_helpers", "my_tasks")  # my_helpers found by following my_tasks' imports
    assert set(bundle.files) == {"data/pairs.jsonl", "my_helpers.py", "my_tasks/__init__.py",
                                 "my_tasks/prompts.jsonl", "my_tasks/sub.py"}
    assert bundle.installed == ("composer_cloud", "json")
    ref = upload_code(Store(store_uri), bundle)
    assert ref.key == f"code/{bundle.sha256}.zip" and ref.bytes == bundle.size
    assert Store(store_uri).exists(ref.key)

    replica_cwd = tmp_path / "replica-cwd"
    replica_cwd.mkdir()
    cache = tmp_path / "cache"
    proc = _run_in_fresh_process(INSTALL_AND_LOAD, store_uri, json.dumps(ref.to_json()), str(cache), cwd=replica_cwd)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["task"] == "mine" and out["words"] == ["a", "b"] and out["bonus"] == 7
    assert [r["prompt"] for r in out["rows"]] == ["p1", "p2"]
    assert out["dir"] == str(cache / bundle.sha256)
    assert out["file"] == str(cache / bundle.sha256 / "my_tasks" / "__init__.py")  # not the user's folder
    assert "chosen" in out["pairs"]


def test_extraction_is_reused_without_reading_the_store(project, elsewhere, tmp_path, store_uri):
    store = Store(store_uri)
    ref = upload_code(store, collect_code(["my_tasks:make_task"], base_dir=project))
    cache = tmp_path / "cache"
    first = install_code(store, ref, cache_dir=cache)
    try:
        store.delete(ref.key)
        assert install_code(store, ref, cache_dir=cache) == first
        assert (first / "my_tasks" / "sub.py").read_text() == "WORDS = ['a', 'b']\n"
        assert stat.S_IMODE((first / "my_tasks" / "sub.py").stat().st_mode) == 0o644
        assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
    finally:
        sys.path.remove(str(first))


def test_replicas_sharing_a_cache_race_safely(project, elsewhere, tmp_path, store_uri):
    from concurrent.futures import ThreadPoolExecutor

    store = Store(store_uri)
    ref = upload_code(store, collect_code(["my_tasks:make_task"], base_dir=project))
    cache = tmp_path / "shared-cache"
    with ThreadPoolExecutor(8) as pool:
        dirs = list(pool.map(lambda _: install_code(store, ref, cache_dir=cache), range(8)))
    try:
        assert set(dirs) == {cache / ref.sha256}
        assert sorted(p.name for p in cache.iterdir()) == [ref.sha256]  # no temporary directories left
        assert (cache / ref.sha256 / "my_helpers.py").is_file()
    finally:
        while str(cache / ref.sha256) in sys.path:  # racing installs may each have prepended it
            sys.path.remove(str(cache / ref.sha256))


def test_identical_code_gives_the_identical_sha(project, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = collect_code(["my_tasks:make_task"], include=["data"], base_dir=project)
    # a copy elsewhere, with other timestamps and permissions, and new bytecode: same bundle
    import shutil

    copy = shutil.copytree(project, tmp_path / "copy")
    for p in copy.rglob("*.py"):
        os.utime(p, (1_700_000_000, 1_700_000_000))
        p.chmod(0o755)
    _write(copy / "my_tasks" / "__pycache__" / "other.pyc", "more junk")
    second = collect_code(["my_tasks:make_task"], include=["data"], base_dir=copy)
    assert second.sha256 == first.sha256 and second.data == first.data

    with zipfile.ZipFile(io.BytesIO(first.data)) as zf:
        infos = zf.infolist()
    assert [i.filename for i in infos] == sorted(i.filename for i in infos)
    assert {i.date_time for i in infos} == {(1980, 1, 1, 0, 0, 0)}
    assert {stat.S_IMODE(i.external_attr >> 16) for i in infos} == {0o644}

    (copy / "my_tasks" / "sub.py").write_text("WORDS = ['a', 'c']\n")
    assert collect_code(["my_tasks:make_task"], include=["data"], base_dir=copy).sha256 != first.sha256


def test_upload_is_write_once_and_repairs_a_damaged_object(project, store_uri):
    store = Store(store_uri)
    bundle = collect_code(["my_tasks:make_task"], base_dir=project)
    ref = upload_code(store, bundle)
    assert upload_code(store, bundle) == ref  # idempotent
    store.put(ref.key, b"not the bundle")
    upload_code(store, bundle)  # a content-addressed key with other bytes is replaced
    assert hashlib.sha256(store.get(ref.key)).hexdigest() == bundle.sha256


def test_tampered_bundle_is_refused_naming_the_key(project, tmp_path, store_uri):
    store = Store(store_uri)
    ref = upload_code(store, collect_code(["my_tasks:make_task"], base_dir=project))
    # a well-framed object (the store's crc passes) with other contents: only the sha256 catches it
    evil = io.BytesIO()
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("my_tasks/__init__.py", "def make_task():\n    return 'evil'\n")
    store.put(ref.key, evil.getvalue())
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumMismatch, match=ref.key) as err:
        install_code(store, ref, cache_dir=cache)
    assert "sha256" in str(err.value)
    assert not (cache / ref.sha256).exists()

    # raw corruption of the stored bytes is refused by the store's framing
    upload_code(store, collect_code(["my_tasks:make_task"], base_dir=project))
    path = Path(store.path(ref.key))
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatch, match=ref.key):
        install_code(store, ref, cache_dir=cache)
    assert not (cache / ref.sha256).exists()


def _zip_with(name: str, *, mode: int = stat.S_IFREG | 0o644, data: bytes = b"x = 1\n") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("ok.py", "y = 2\n")
        info = zipfile.ZipInfo(name)
        info.external_attr = mode << 16
        info.create_system = 3
        zf.writestr(info, data)
    return buf.getvalue()


@pytest.mark.parametrize("name,mode,reason", [
    ("../x.py", stat.S_IFREG | 0o644, "'..'"),
    ("pkg/../../x.py", stat.S_IFREG | 0o644, "'..'"),
    ("/tmp/abs_x.py", stat.S_IFREG | 0o644, "absolute"),
    ("C:/x.py", stat.S_IFREG | 0o644, "absolute"),
    ("..\\x.py", stat.S_IFREG | 0o644, "non-POSIX"),
    ("link.py", stat.S_IFLNK | 0o777, "symbolic link"),
    ("fifo", stat.S_IFIFO | 0o644, "not a regular file"),
])
def test_unsafe_archive_entries_are_refused(tmp_path, store_uri, name, mode, reason):
    store = Store(store_uri)
    data = _zip_with(name, mode=mode, data=b"/etc/passwd" if stat.S_ISLNK(mode) else b"x = 1\n")
    sha = hashlib.sha256(data).hexdigest()
    store.put(code_key(sha), data)  # a forged object whose sha256 matches its forged reference
    ref = CodeRef(key=code_key(sha), sha256=sha, bytes=len(data), modules=())
    cache = tmp_path / "deep" / "cache"
    with pytest.raises(UnsafeArchive, match=reason) as err:
        install_code(store, ref, cache_dir=cache)
    assert err.value.key == ref.key and err.value.entry == name
    assert not (cache / sha).exists() and not list(cache.glob(".tmp-*"))  # nothing extracted, nothing left over
    assert not (tmp_path / "deep" / "x.py").exists() and not (tmp_path / "x.py").exists()
    assert not Path("/tmp/abs_x.py").exists()


def test_archive_with_a_file_and_a_directory_of_the_same_name_is_refused(tmp_path, store_uri):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("a", "file")
        zf.writestr("a/b.py", "x = 1\n")
    data = buf.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    Store(store_uri).put(code_key(sha), data)
    with pytest.raises(UnsafeArchive, match="also a file"):
        install_code(Store(store_uri), CodeRef(code_key(sha), sha, len(data), ()), cache_dir=tmp_path / "c")


def test_missing_module_names_the_setting_and_what_to_do(project, elsewhere):
    with pytest.raises(CodeNotFound) as err:
        collect_code({"trainer.hint_source": "no_such_module.sub:make"}, base_dir=project)
    msg = str(err.value)
    assert "trainer.hint_source" in msg and "'no_such_module'" in msg and str(project) in msg
    assert "PYTHONPATH" in msg
    assert isinstance(err.value, BadReference)  # handled like every other bad 'module:attr' setting
    # found once the right folder is given
    assert collect_code({"trainer.task": "my_tasks:make_task"}, base_dir=project).modules


def test_installed_modules_are_not_packaged(elsewhere):
    bundle = collect_code(["json:loads", "composer_cloud.trainer.three_channel.tasks:PythonFunctionsTask", "fsspec:filesystem",
                           "os.path:join", "sys:exit", "python-functions"])
    assert bundle.empty and bundle.files == () and bundle.modules == ()
    assert bundle.installed == ("composer_cloud", "fsspec", "json", "os", "sys")


def test_composer_cloud_is_not_packaged_even_from_a_checkout(monkeypatch):
    monkeypatch.chdir(REPO)  # composer_cloud/ is a plain folder in the base directory here
    bundle = collect_code(["composer_cloud.trainer.three_channel.tasks:PythonFunctionsTask"], base_dir=REPO)
    assert bundle.empty and bundle.installed == ("composer_cloud",)


def test_a_bare_folder_and_a_single_file_module_are_packaged(tmp_path, elsewhere):
    _write(tmp_path / "nspkg" / "tasks.py", "def make():\n    return 1\n")  # no __init__.py
    _write(tmp_path / "single.py", "def make():\n    return 2\n")
    bundle = collect_code(["nspkg.tasks:make", "single:make"], base_dir=tmp_path)
    assert bundle.modules == ("nspkg", "single")
    assert bundle.files == ("nspkg/tasks.py", "single.py")


def test_include_errors_name_the_path(project, elsewhere, tmp_path):
    with pytest.raises(UserCodeError, match="no_such.jsonl.*does not exist"):
        collect_code([], include=["no_such.jsonl"], base_dir=project)
    outside = _write(tmp_path / "outside.txt", "x")
    with pytest.raises(UserCodeError, match="outside"):
        collect_code([], include=["../outside.txt"], base_dir=project)
    with pytest.raises(UserCodeError, match="outside"):
        collect_code([], include=[outside], base_dir=project)
    whole = collect_code([], include=["."], base_dir=project)  # the whole folder, minus junk
    assert "unrelated.py" in whole.files and "my_tasks/.env" not in whole.files
    assert not [f for f in whole.files if "__pycache__" in f or f.endswith(".pyc")]


def test_size_limit_names_the_largest_files(project, elsewhere):
    (project / "my_tasks" / "weights.bin").write_bytes(b"\0" * 5000)
    with pytest.raises(BundleTooLarge) as err:
        collect_code(["my_tasks:make_task"], base_dir=project, max_bytes=4096)
    assert "my_tasks/weights.bin (5000 bytes)" in str(err.value) and "4096" in str(err.value)


def _upload(store: Store, paths: list, *, base_dir: Path | None = None) -> dict[str, str]:
    """What ``launch`` does with the local paths a spec names: pack each, put it write-once."""
    keys = {}
    for given in paths:
        key, data, sha = pack_path((base_dir or Path.cwd()) / given, given=str(given))
        put_verified(store, key, data, sha)
        keys[str(given)] = key
    return keys


def test_local_files_and_directories_travel_by_content(project, elsewhere, tmp_path, store_uri):
    store = Store(store_uri)
    model = project / "tiny-model"
    _write(model / "config.json", '{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    _write(model / ".git" / "HEAD", "ref")
    keys = _upload(store, ["data/pairs.jsonl", "tiny-model"], base_dir=project)
    pairs_sha = hashlib.sha256((project / "data" / "pairs.jsonl").read_bytes()).hexdigest()
    assert keys["data/pairs.jsonl"] == f"files/{pairs_sha}/pairs.jsonl"
    assert keys["tiny-model"].startswith("dirs/") and keys["tiny-model"].endswith("/tiny-model.zip")
    assert _upload(store, [model]) == {str(model): keys["tiny-model"]}  # same content, same key

    cache = tmp_path / "files-cache"
    got = fetch_file(store, keys["data/pairs.jsonl"], cache_dir=cache)
    assert got.name == "pairs.jsonl" and got.read_bytes() == (project / "data" / "pairs.jsonl").read_bytes()
    got_model = fetch_file(store, keys["tiny-model"], cache_dir=cache)
    assert got_model.is_dir() and got_model.name == "tiny-model"
    assert sorted(p.name for p in got_model.iterdir()) == ["config.json", "model.safetensors"]
    assert (got_model / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()

    store.put(keys["data/pairs.jsonl"], b'{"chosen": "forged"}\n')
    with pytest.raises(ChecksumMismatch, match=keys["data/pairs.jsonl"]):
        fetch_file(store, keys["data/pairs.jsonl"], cache_dir=tmp_path / "fresh-cache")
    for bad in ("files/abc/x", f"files/{pairs_sha}/..", f"dirs/{pairs_sha}/model", "../files/x"):
        with pytest.raises(ValueError, match="not a key written by pack_path"):
            fetch_file(store, bad, cache_dir=cache)
    with pytest.raises(UserCodeError, match="missing.jsonl"):
        _upload(store, ["missing.jsonl"], base_dir=project)


def test_code_ref_from_untrusted_json_is_validated(tmp_path):
    sha = "a" * 64
    ref = CodeRef.from_json({"key": f"code/{sha}.zip", "sha256": sha, "bytes": 10, "modules": ["m"]})
    assert CodeRef.from_json(ref.to_json()) == ref
    with pytest.raises(ValueError, match="not the bundle key"):  # refused before the store is read
        install_code(Store(f"file://{tmp_path}/s"), CodeRef.from_json({**ref.to_json(), "key": "code/../../e.zip"}),
                     cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="not a sha256"):
        CodeRef.from_json({**ref.to_json(), "sha256": "../x", "key": "code/../x.zip"})
    with pytest.raises(ValueError, match="invalid code reference"):
        CodeRef.from_json({"key": "code/x.zip"})


def test_code_travels_through_an_s3_store(project, elsewhere, tmp_path, s3_endpoint):
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket="usercode")
    store = Store("s3://usercode/run-1")
    bundle = collect_code(["my_tasks:make_task"], base_dir=project)
    ref = upload_code(store, bundle)
    assert upload_code(store, bundle) == ref  # the write-once create loses, the object is verified and kept
    where = install_code(store, ref, cache_dir=tmp_path / "cache")
    try:
        assert (where / "my_tasks" / "sub.py").is_file()
    finally:
        sys.path.remove(str(where))
