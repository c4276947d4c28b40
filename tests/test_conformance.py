"""The store conformance probe on real stores (file://, moto, SeaweedFS) and on a store that ignores write-once."""

from __future__ import annotations

import pytest

from composer_cloud.storage.conformance import (
    PROBE_PREFIX,
    ConformanceReport,
    PropertyCheck,
    StoreNotConforming,
    format_report,
    probe_store,
    require_conformance,
)
from composer_cloud.errors import StoreConfigError
from composer_cloud.storage.store import Store
from storeproxy import StoreProxy

REQUIRED = ["conditional_create", "concurrent_create", "read_after_write", "list_after_write",
            "overwrite_visibility", "delete", "no_partial_reads"]


def _assert_conforms(report: ConformanceReport) -> None:
    assert report.ok, format_report(report)
    assert report.failures() == []
    names = [c.name for c in report.checks]
    assert names[:len(REQUIRED)] == REQUIRED
    assert all(c.required for c in report.checks if c.name in REQUIRED)


def test_local_store_conforms_and_the_probe_cleans_up(tmp_path):
    uri = f"file://{tmp_path}/store"
    report = probe_store(uri)
    _assert_conforms(report)
    assert report.store == uri
    assert all(c.ok for c in report.checks)  # informational ones too, on a filesystem
    assert list((tmp_path / "store").iterdir()) == []


def test_s3_stores_conform_and_the_probe_cleans_up(s3_store):
    uri = f"s3://{s3_store.bucket}/conformance"
    report = probe_store(uri)
    _assert_conforms(report)
    assert Store(uri).list(PROBE_PREFIX) == []


def test_a_store_that_ignores_if_none_match_is_refused_by_name(s3_store):
    with StoreProxy(s3_store.endpoint) as proxy:
        proxy.set_mode("strip-if-none-match")
        report = probe_store(f"s3://{s3_store.bucket}/split-brain", storage_options={"endpoint_url": proxy.endpoint})
        assert proxy.counts["stripped"] > 0
    assert not report.ok
    failed = {c.name for c in report.failures()}
    assert failed == {"conditional_create", "concurrent_create"}, format_report(report)
    text = format_report(report)
    assert f"s3://{s3_store.bucket}/split-brain" in text and "DOES NOT CONFORM" in text
    assert "FAIL  conditional_create" in text and "If-None-Match" in text
    # The stripped creates still wrote objects: the probe removed them.
    assert Store(f"s3://{s3_store.bucket}/split-brain").list(PROBE_PREFIX) == []

    with StoreProxy(s3_store.endpoint) as proxy:
        proxy.set_mode("strip-if-none-match")
        with pytest.raises(StoreConfigError, match="split-brain does not provide conditional_create, "
                                                   "concurrent_create") as err:
            require_conformance(f"s3://{s3_store.bucket}/split-brain",
                                storage_options={"endpoint_url": proxy.endpoint})
    assert isinstance(err.value, StoreNotConforming) and not err.value.report.ok
    assert require_conformance(f"s3://{s3_store.bucket}/split-brain").ok


def test_a_store_that_serves_objects_while_they_are_written_is_refused_by_name(s3_store):
    uri = f"s3://{s3_store.bucket}/half-written"
    with StoreProxy(s3_store.endpoint) as proxy:
        proxy.set_mode("serve-partial", delay_s=1.0)
        with pytest.raises(StoreNotConforming, match="half-written does not provide no_partial_reads") as err:
            require_conformance(uri, storage_options={"endpoint_url": proxy.endpoint})
        assert proxy.counts["served-partial"] > 0
    check = next(c for c in err.value.report.checks if c.name == "no_partial_reads")
    assert not check.ok and "partial object" in check.detail and "of 8388608 bytes" in check.detail
    assert [c.name for c in err.value.report.failures()] == ["no_partial_reads"]  # the rest of the store is fine
    assert Store(uri).list(PROBE_PREFIX) == []


def test_a_conforming_store_is_probed_once_per_process(s3_store):
    uri = f"s3://{s3_store.bucket}/probed-once"
    with StoreProxy(s3_store.endpoint) as proxy:
        options = {"endpoint_url": proxy.endpoint}
        first = require_conformance(uri, storage_options=options)
        probed = len(proxy.requests)
        assert first.ok and probed > 0
        assert require_conformance(uri, storage_options=options) is first
        assert len(proxy.requests) == probed  # cached: no request at all
        # A failing store is probed every time (it may be fixed), and never cached as conforming.
        proxy.set_mode("strip-if-none-match")
        other = f"s3://{s3_store.bucket}/probed-twice"
        for _ in range(2):
            with pytest.raises(StoreNotConforming):
                require_conformance(other, storage_options=options)
        proxy.set_mode("pass")
        assert require_conformance(other, storage_options=options).ok


def test_an_unreachable_store_raises_store_config_error_naming_it(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    with pytest.raises(StoreConfigError, match="cannot reach store s3://cc-test/x at http://127.0.0.1:1"):
        probe_store("s3://cc-test/x")


def test_a_missing_bucket_raises_store_config_error(s3_store):
    with pytest.raises(StoreConfigError, match="bucket 'no-such-bucket' .* does not exist"):
        probe_store("s3://no-such-bucket/x")


def test_format_report_marks_failures_and_notes():
    report = ConformanceReport("s3://b/p", [
        PropertyCheck("conditional_create", False, "both won"),
        PropertyCheck("read_after_write", True, "fine"),
        PropertyCheck("empty_prefix_cleanup", False, "still listed", required=False),
    ])
    assert not report.ok and [c.name for c in report.failures()] == ["conditional_create"]
    lines = format_report(report).splitlines()
    assert lines[0] == "store s3://b/p: DOES NOT CONFORM (1 required property failed)"
    assert lines[1].split() == ["FAIL", "conditional_create", "both", "won"]
    assert lines[2].split()[:2] == ["ok", "read_after_write"]
    assert lines[3].split()[:2] == ["note", "empty_prefix_cleanup"]
    only_note = ConformanceReport("s3://b/p", [PropertyCheck("empty_prefix_cleanup", False, "x", required=False)])
    assert only_note.ok and format_report(only_note).startswith("store s3://b/p: conforms")
