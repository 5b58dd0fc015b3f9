"""The interface every system implements, and the registry the runner looks systems up in.

The runner never branches on a system's name: it validates a layout, launches processes and
calls `setup`, `train_step` and `teardown`. A new system is one new module in systems/ that
subclasses `SystemAdapter` and decorates itself with `@register`.
"""
from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import systems


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line saying what and how to fix."""


@dataclass(frozen=True)
class Layout:
    label: str                     # short, for tables and figures: "tp2-pp1-dp1"
    num_devices: int               # devices the run uses (MFU counts all of them)
    details: dict[str, Any]        # system-specific: degrees, rank lists, plan
    # Over how many data-parallel ranks each module splits the global batch; the data
    # plan and the load-imbalance metrics are computed per module from it.
    module_dp: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "num_devices": self.num_devices, "module_dp": self.module_dp, **self.details}


@dataclass
class StepOutput:
    """What one rank contributes to a training step's record.

    Loss sums are over the samples this rank is *responsible* for (one replica per sample
    contributes), so an all-reduce SUM over the world, divided by the global batch size,
    gives the global mean loss whatever the layout.
    """
    loss_sum: float = 0.0
    lm_loss_sum: float = 0.0
    gen_loss_sum: float = 0.0
    module_busy_s: dict[str, float] = field(default_factory=dict)   # this rank's compute time per module
    timeline: list[dict] = field(default_factory=list)             # optional per-rank events


class SystemAdapter(ABC):
    name: ClassVar[str]
    # A monolithic baseline the others are compared against (reports give every other
    # system's ratio to each baseline); False for the systems under study.
    baseline: ClassVar[bool] = False
    # Option names this system accepts through `--set`, with defaults.
    options: ClassVar[dict[str, Any]] = {}

    @abstractmethod
    def layout(self, options: dict[str, Any], nproc: int, workload, global_batch_size: int,
               micro_batch_size: int) -> Layout:
        """Validate the options for this process count and workload, without processes.
        Raise ConfigError with a one-line message when they do not fit."""

    @abstractmethod
    def setup(self, ctx) -> None:
        """Build model, optimizer and process groups on this rank (inside torchrun)."""

    @abstractmethod
    def train_step(self, step: int) -> StepOutput:
        """One optimizer step over the global batch of `step` (fetched from ctx.data)."""

    def weight_updates(self) -> dict[str, float] | None:
        """Optional: this rank's share of the squared weight update per module (see
        systems._mcore.UpdateTracker); summed over ranks it lets tests compare layouts."""
        return None

    def teardown(self) -> None:
        """Release what setup created; must leave no collective in flight."""


_REGISTRY: dict[str, type[SystemAdapter]] = {}


def register(cls: type[SystemAdapter]) -> type[SystemAdapter]:
    if cls.name in _REGISTRY:
        raise ValueError(f"system {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _discover() -> None:
    for info in pkgutil.iter_modules(systems.__path__):
        if info.name not in ("base", "cpu_compat") and not info.name.startswith("_"):
            importlib.import_module(f"systems.{info.name}")


def system_names() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def baseline_names() -> list[str]:
    """The registered systems that are baselines, in name order."""
    _discover()
    return sorted(n for n, cls in _REGISTRY.items() if cls.baseline)


def get_system(name: str) -> SystemAdapter:
    _discover()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown system {name!r}; choose one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]()
