"""Records of a run as a whole: heartbeats, metrics digests, job handles, resumes, the cancel request, the code ref.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from composer_cloud.storage.records.fields import SHA256, as_object, float_field, int_field, is_int, sha256_field


class HeartbeatState(str, enum.Enum):
    """What a replica says about itself in its heartbeat."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return value if is_int(value) else None


@dataclass(frozen=True)
class Heartbeat:
    """``replicas/<rank>.json``: a replica's state, position and live progress (rewritten as it goes).

    ``progress`` holds the live figures (:class:`~composer_cloud.replica.telemetry.Progress`:
    ``step``, ``loss``, ``loss_ema``, ``reward``, ``steps_per_s``, ``tokens_per_s``, ``elapsed_s``,
    ``started_at``...), stored flat beside the other fields. ``round`` is the
    lock-step round, or the decoupled contribution count.
    """

    rank: int
    state: HeartbeatState
    time: float
    pid: int | None = None
    versions: dict[str, str] = field(default_factory=dict)
    progress: dict[str, Any] = field(default_factory=dict)
    round: int | None = None
    step: int | None = None
    version: int | None = None
    final_version: int | None = None
    error: str = ""
    params_sha256: str | None = None

    _FIELDS = ("rank", "state", "time", "pid", "versions", "round", "step", "version", "final_version", "error",
               "params_sha256")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.progress, "rank": self.rank, "state": self.state.value, "time": self.time,
                               "pid": self.pid, "versions": self.versions}
        for name in ("round", "step", "version", "final_version", "params_sha256"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.error:
            out["error"] = self.error
        return out

    @classmethod
    def from_json(cls, obj: Any, *, rank: int) -> "Heartbeat | None":
        """Lenient: None if ``obj`` is not a heartbeat at all; a malformed field reads as unknown."""
        if not isinstance(obj, dict):
            return None
        try:
            state = HeartbeatState(obj.get("state"))
        except ValueError:
            return None
        versions = obj.get("versions")
        sha = obj.get("params_sha256")
        return cls(rank=rank, state=state, time=_num(obj.get("time")) or 0.0, pid=_int(obj.get("pid")),
                   versions={str(k): str(v) for k, v in versions.items()} if isinstance(versions, dict) else {},
                   progress={k: v for k, v in obj.items() if k not in cls._FIELDS},
                   round=_int(obj.get("round")), step=_int(obj.get("step")), version=_int(obj.get("version")),
                   final_version=_int(obj.get("final_version")), error=str(obj.get("error") or ""),
                   params_sha256=sha if isinstance(sha, str) else None)

    def number(self, name: str) -> float | None:
        """A live progress figure as a float (None when absent or malformed)."""
        return _num(self.progress.get(name))


@dataclass(frozen=True)
class MetricsDigest:
    """The framed digest written after a metrics object (``metrics/<rank>/<round>-<writer>.json``)."""

    sha256: str
    bytes: int
    rows: int
    rank: int
    round: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any, *, key: str) -> "MetricsDigest":
        obj = as_object(obj, key)
        return cls(sha256=sha256_field(obj, "sha256", key), bytes=int_field(obj, "bytes", key),
                   rows=int_field(obj, "rows", key), rank=int_field(obj, "rank", key),
                   round=int_field(obj, "round", key))


# --------------------------------------------------------------------------- launch records
@dataclass
class JobHandle:
    """How to find one replica job again (``executor/<rank>.json``). JSON-serialisable; never holds a secret.

    Attributes:
        executor: executor name (``local``, ``modal``, ``hf-jobs``).
        rank: replica rank.
        job_id: the backend's id (process id, FunctionCall id, HF job id).
        data: backend-specific details (log path, namespace, app id, ...).
        restarts: how many times the executor relaunched this replica.
    """

    executor: str
    rank: int
    job_id: str
    data: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "JobHandle":
        return cls(
            executor=str(d["executor"]),
            rank=int(d["rank"]),
            job_id=str(d["job_id"]),
            data=dict(d.get("data", {})),
            restarts=int(d.get("restarts", 0)),
        )


@dataclass(frozen=True)
class ResumeRecord:
    """``resumes/<n>.json``: the n-th resume restarted the run after checkpoint ``from_round`` (-1: the start)."""

    from_round: int
    executor: str
    replicas: int
    time: float

    def to_json(self) -> dict[str, Any]:
        return {"from_round": self.from_round, "time": self.time, "executor": self.executor,
                "replicas": self.replicas}

    @classmethod
    def from_json(cls, obj: Any, *, key: str) -> "ResumeRecord":
        obj = as_object(obj, key)
        executor, replicas, t = obj.get("executor"), obj.get("replicas"), obj.get("time")
        return cls(from_round=int_field(obj, "from_round", key, lo=-1), executor=str(executor or ""),
                   replicas=replicas if is_int(replicas) else 0, time=float(t) if isinstance(t, (int, float)) else 0.0)


@dataclass(frozen=True)
class CancelRecord:
    """``control/cancel.json``: the run was cancelled (write-once). It counts only once read and parsed (and,
    in a signed run, verified): an object that merely exists there decides nothing."""

    time: float

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time}

    @classmethod
    def from_json(cls, obj: Any, *, key: str) -> "CancelRecord":
        return cls(time=float_field(as_object(obj, key), "time", key))


@dataclass(frozen=True)
class CodeRef:
    """Where a run's code bundle lies in its store (``code/<sha256>.zip``), and the sha256 it must have.

    Travels in the spec (``code.ref``) and in each job's environment, so a
    replica checks the bundle against a digest that did not come from the store.
    """

    key: str
    sha256: str
    bytes: int
    modules: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "modules": list(self.modules)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "CodeRef":
        """Parse and validate the fields (the JSON may have travelled through an untrusted store); the key is
        checked against the digest where it is used (:func:`composer_cloud.replica.usercode.install_code`)."""
        try:
            ref = cls(key=str(obj["key"]), sha256=str(obj["sha256"]), bytes=int(obj["bytes"]),
                      modules=tuple(str(m) for m in obj["modules"]))
            if not SHA256.fullmatch(ref.sha256):
                raise ValueError(f"{ref.sha256!r:.80} is not a sha256 hex digest")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid code reference {dict(obj)!r:.200}: {exc}") from None
        return ref
