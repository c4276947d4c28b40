"""What a trainer declares to the launcher and the client: the one place ``runs/`` learns about a trainer.

A trainer's settings class (the :data:`~composer_cloud.trainer.settings.TRAINERS` entry) derives from
:class:`TrainerPlugin` and overrides what applies to it:

* :attr:`TrainerPlugin.CODE_SETTINGS` and :meth:`TrainerPlugin.names_code`: which settings may name code a
  replica imports (``"module:attr"``). ``launch`` packages exactly these and ``runs/signing`` refuses an
  unvouched spec that sets one, so the two can never disagree (``trainer.hint_source = "column:hint"`` names a
  dataset column, not code, and is neither packaged nor refused).
* :meth:`TrainerPlugin.check_launch`, :meth:`TrainerPlugin.dataset_problems` and
  :meth:`TrainerPlugin.launch_refusal`: the launch's checks of this trainer (``--dry-run`` runs them too).
* :attr:`TrainerPlugin.LOSS_CHANNELS`, :meth:`TrainerPlugin.launch_notes` and
  :meth:`TrainerPlugin.silence_reasons`: what the launch summary and ``status`` say about a run of it.
* :meth:`TrainerPlugin.training_plan`: the trainer side of the plan ``launch --dry-run`` prints.

Every method has a default that says nothing, so a user trainer (``"module:SettingsClass"``) needs none of
them. Nothing here imports torch or TRL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from composer_cloud.registry import is_reference


class TrainerPlugin:
    """The launcher's and the client's view of one trainer; mixed into its settings class.

    Invariant: the methods read only the parsed settings (``self``) and what they are given; none writes
    anything or reaches the network.
    """

    #: ``[trainer]`` keys whose value may be a ``"module:attr"`` reference to code a replica imports.
    CODE_SETTINGS: ClassVar[tuple[str, ...]] = ()
    #: metric key of each loss channel in the step rows -> its name for users (the summary's per-channel means).
    LOSS_CHANNELS: ClassVar[dict[str, str]] = {}
    #: what the step rows' ``train_loss`` is, for people (None: "<trainer> loss").
    LOSS_NAME: ClassVar[str | None] = None
    #: step-row fields that diagnose a run short of ``grad_norm = 0`` -> their names for users (the summary shows
    #: each first -> last committed round).
    DIAGNOSIS: ClassVar[dict[str, str]] = {}

    @classmethod
    def names_code(cls, key: str, value: str) -> bool:
        """Whether ``value`` of setting ``key`` (one of :attr:`CODE_SETTINGS`) names code to import."""
        return is_reference(value)

    @classmethod
    def code_references(cls, settings: Mapping[str, Any]) -> dict[str, str]:
        """``{"trainer.<key>": "module:attr"}``: the settings of a raw ``[trainer]`` table that name code.

        Works on the raw table (no parse, nothing imported), so ``runs/signing`` can ask it of a spec that
        nothing vouches for.
        """
        return {f"trainer.{k}": v for k in cls.CODE_SETTINGS
                if isinstance(v := settings.get(k), str) and cls.names_code(k, v)}

    def check_launch(self, spec: Any) -> None:
        """Refuse a spec this trainer cannot run where its replicas will run (``ValueError``, naming the field)."""

    def dataset_problems(self, available: Sequence[str]) -> list[str]:
        """What is missing from a dataset with columns ``available`` for this trainer (empty: nothing)."""
        return []

    def launch_refusal(self, columns: Sequence[str] | None) -> str | None:
        """Why a run with these settings can produce no gradient at all (None: it can, or cannot be told).

        ``columns`` are the dataset's columns when the launcher could read them (None: unknown).
        """
        return None

    def launch_notes(self, columns: Sequence[str] | None) -> list[str]:
        """Lines the launch summary prints about what these settings train on (``columns``: as above)."""
        return []

    def training_plan(self, device_type: str) -> list[tuple[str, str]]:
        """``(label, value)`` rows of the plan ``launch --dry-run`` prints for replicas computing on
        ``device_type`` (``"cuda"``, ``"cpu"``): what the trainer will do, resolved as its replicas resolve
        it (loss channels and their inputs, the data, the rollout mode on that device, generations per prompt,
        batch sizes). Empty: nothing to show beyond what the launcher knows itself."""
        return []

    def diagnosis_notes(self, diagnosis: Mapping[str, tuple[float, float]]) -> list[str]:
        """What to change, from :attr:`DIAGNOSIS`'s ``{field: (first round, last round)}`` (empty: nothing)."""
        return []

    def silence_reasons(self, steps: Sequence[Mapping[str, Any]]) -> list[str]:
        """Why step rows whose ``grad_norm`` was 0 got no gradient, each with what to change (empty: unknown)."""
        return []


__all__ = ["TrainerPlugin"]
