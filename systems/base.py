"""The contract every system implements, and the registry that finds systems by name.

A system is one module (or package) in systems/ that subclasses `SystemAdapter` and decorates
itself with `@register`. The same adapter serves every path:
  - `bench run`: `layout()` validates the options before any process starts; inside torchrun
    the worker calls `setup(ctx)`, `train_step(step)` and `teardown()`;
  - `bench simulate` / `bench validate`: `layout(..., simulated=True)` and `simulate_step()`,
    which prices one iteration with the shared cost model handed in as `kit`;
  - `plan=auto` (any option set to "auto") and `--layout auto`: `search_layout()`.
Nothing outside systems/ branches on a system's name. Systems never import bench/: the
simulator passes its cost model in (`kit` is the module bench.sim.kit), so imports go one way.

Systems outside this folder (a user's, or a test's) register by being imported: name their
modules in BENCH_PLUGINS (comma-separated), which every process of a run inherits.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypedDict

import systems
from workloads.presets import ATTENTION, MODULES, Workload

PLUGINS_ENV = "BENCH_PLUGINS"
TIMELINE_KINDS = ("fwd", "bwd", "comm", "idle")
# The parts of a step a system may time on each rank (StepOutput.phase_s): the forward/backward
# schedule up to the gradient reduction, the DP gradient reduction after it (waiting for the
# slowest replica included), and the optimizer step (with its parameter all-gather, if any).
STEP_PHASES = ("compute", "grad_sync", "optimizer")


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line saying what and how to fix."""


# ATTENTION (workloads.presets): the attention cores every system's layers can run. The
# simulator prices a fused core on GPUs (bench.sim.gemm), so its GPU layouts name sdpa.


def attention_option(options) -> str:
    """The `attention` option checked: local or sdpa (one line otherwise)."""
    attention = options.get("attention", "local")
    if attention not in ATTENTION:
        raise ConfigError(f"attention={attention!r}; choose local (megatron-core DotProductAttention) or sdpa "
                          f"(torch scaled_dot_product_attention)")
    return attention


def simulated_attention(cluster) -> str:
    """The attention a layout search names for `cluster`: sdpa on GPUs, whose cost model prices a
    fused core; local on a CPU, whose profile measured the adapters' default."""
    return "local" if cluster.gpu == "CPU" else "sdpa"


@dataclass(frozen=True)
class Layout:
    label: str                     # short, one per configuration, the same measured and simulated
    num_devices: int               # devices the layout uses (MFU counts all of them)
    details: dict[str, Any]        # system-specific: degrees, rank lists, plan
    # Over how many data-parallel ranks each module splits the global batch; the data
    # plan and the load-imbalance metrics are computed per module from it.
    module_dp: dict[str, int] = field(default_factory=dict)
    # The finest data-parallel split every module's split is a coarsening of: the data plan
    # assigns samples to this many groups, and each module merges them to its own DP size.
    canonical_groups: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "num_devices": self.num_devices, "module_dp": self.module_dp,
                "canonical_groups": self.canonical_groups, **self.details}


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    # Off by default; when set, every system clips by the whole model's gradient norm.
    clip_grad: float = 0.0


class MicrobatchSource(Protocol):
    """Where a rank gets its data (bench.data.source): preprocessed in the trainer or streamed
    from disaggregated preprocessing workers; the same samples either way."""
    wait_s: float

    def microbatches(self, step: int, dp_rank: int, dp_size: int, micro_batch_size: int | None = None) -> list: ...


@dataclass
class TrainContext:
    """What a system's `setup` gets on each rank (built by bench.run.worker)."""
    options: dict[str, Any]        # the system's resolved options (no "auto" left)
    seed: int
    optim: OptimConfig
    global_batch_size: int
    micro_batch_size: int
    workload: Workload
    layout: Layout
    rank: int
    world_size: int
    device: Any                    # torch.device
    dtype: Any                     # torch.dtype
    data: MicrobatchSource


class TimelineEvent(TypedDict):
    """One interval of one rank's last step, for the per-rank timeline figure."""
    module: str                    # one of MODULES
    kind: str                      # one of TIMELINE_KINDS
    start_s: float                 # seconds since the step started on this rank
    end_s: float


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
    grad_norm: float | None = None   # the global gradient norm before clipping, where the optimizer gives it
    module_busy_s: dict[str, float] = field(default_factory=dict)   # this rank's compute time per module
    timeline: list[TimelineEvent] = field(default_factory=list)     # only if records_timeline
    # seconds of this rank's step in each of STEP_PHASES; empty if the system does not split its step
    phase_s: dict[str, float] = field(default_factory=dict)
    # the training thread's CPU seconds in each phase and its seconds waiting for a core
    # (systems.clock.PhaseClock); the rest of a phase's wall seconds it slept, on a collective or
    # a helper thread. Empty where not timed (the runqueue: where the kernel does not report it).
    phase_cpu_s: dict[str, float] = field(default_factory=dict)
    phase_runqueue_s: dict[str, float] = field(default_factory=dict)
    # the CPU seconds of all the rank's threads in each phase: beyond phase_cpu_s, what its helper
    # threads did meanwhile (gloo copies on its own: a DP-1 parameter all-gather is such a copy)
    phase_process_cpu_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SimStep:
    """One global batch, as the simulator hands it to `simulate_step`."""
    workload: Workload
    costs: Any                     # bench.sim.costs.BatchCosts: per-sample, per-image FLOPs and tokens
    cluster: Any                   # bench.sim.cluster.Cluster
    micro_batch_size: int
    reorder: bool                  # the simulator's own reordering (paper-scale what-ifs)
    runtime_order: Any = None      # bench.sim.batch.RuntimeOrder: the trainers' own assignment, or None
    # optim.clip_grad of the run: > 0, the optimizers clip by the whole model's gradient norm, one
    # all-reduce that every rank of the step meets at (DistTrain's modules too: systems.mcore)
    clip_grad: float = 0.0


@dataclass(frozen=True)
class StepCost:
    """One simulated iteration of one system."""
    pipeline_s: float              # forward/backward schedule to the pipeline flush
    sync_and_host_s: float         # gradient sync, optimizer and host work after the flush
    busy_device_s: float           # device-seconds of compute (for the bubble fraction)
    memory_bytes: float            # the most any device holds
    devices_used: int
    microbatch_flops: list[list[float]]   # first microbatches' FLOPs per module (encoder, backbone, generator)
    # Seconds the busiest trainer rank spends reading and preprocessing its samples (kit.costs.
    # data_time); the simulator decides how much of it the step waits for (bench.sim.preprocess).
    data_s: float = 0.0


class SystemAdapter(ABC):
    name: ClassVar[str]
    # A monolithic baseline the others are compared against (reports give every other
    # system's ratio to each baseline); False for the systems under study.
    baseline: ClassVar[bool] = False
    # Among baselines, the lowest comes first (the default reference of speedups).
    baseline_order: ClassVar[int] = 100
    # Option names this system accepts through `--set`, with defaults.
    options: ClassVar[dict[str, Any]] = {}
    # True: the worker gathers StepOutput.timeline of the last step from every rank.
    records_timeline: ClassVar[bool] = False
    # True: the simulator applies data reordering (workloads.reorder) unless told otherwise.
    # It is DistTrain's technique; a baseline is simulated as it ships, without it, unless asked.
    reorders_data: ClassVar[bool] = False
    # The module that prices this system in the simulator (imported only when simulating): it
    # defines simulate_step(layout, step, kit) and search(workload, n, cluster, kit, **kw); or
    # override the two methods below.
    sim_module: ClassVar[str | None] = None
    # Options `--layout auto` can keep at a given value while it searches the rest (search_layout's
    # `fixed`); any other --set option with --layout auto is an input error before anything runs.
    search_keeps: ClassVar[frozenset[str]] = frozenset()
    # Options added after runs were recorded: left out of bench.config.config_key while at their
    # default, so the repeats recorded before them keep their configuration.
    key_skips_defaults: ClassVar[frozenset[str]] = frozenset()

    def check_run(self, cfg) -> None:
        """Optional: refuse (ConfigError, one line) a resolved run config (bench.config.RunConfig)
        that this system would train differently from what it says, before anything launches."""

    @abstractmethod
    def layout(self, options: dict[str, Any], nproc: int, workload: Workload, global_batch_size: int,
               micro_batch_size: int, *, simulated: bool = False) -> Layout:
        """Validate the options for this device count and workload, without processes; raise
        ConfigError with a one-line message when they do not fit. simulated=True: a layout for
        the simulator, which may leave devices idle and model what the runtime does not run."""

    def options_from_label(self, label: str) -> dict[str, Any]:
        """The options whose layout has this label (`bench simulate --layout LABEL`)."""
        raise ConfigError(f"system {self.name!r} has no layout labels to parse; give its options with --set")

    @abstractmethod
    def setup(self, ctx: TrainContext) -> None:
        """Build model, optimizer and process groups on this rank (inside torchrun)."""

    @abstractmethod
    def train_step(self, step: int) -> StepOutput:
        """One optimizer step over the global batch of `step` (fetched from ctx.data)."""

    def weight_updates(self) -> dict[str, float] | None:
        """Optional: this rank's share of the squared weight update per module (see
        systems.mcore.UpdateTracker); summed over ranks it lets tests compare layouts."""
        return None

    def teardown(self) -> None:
        """Release what setup created; must leave no collective in flight."""

    # ---- simulation -------------------------------------------------------------------------
    def simulate_step(self, layout: Layout, step: SimStep, kit) -> StepCost:
        """One iteration priced with the shared cost model `kit` (bench.sim.kit)."""
        if self.sim_module is None:
            raise NotImplementedError(f"system {self.name!r} has no cost model")
        return importlib.import_module(self.sim_module).simulate_step(layout, step, kit)

    def search_layout(self, workload: Workload, num_devices: int, cluster, kit, *, seed: int,
                      global_batch_size: int, micro_batch_size: int, exact: bool,
                      fixed: dict | None = None) -> dict[str, Any] | None:
        """The options of the fastest layout the cost model finds (plus "estimate_s" and what
        the search did), or None if nothing fits. exact=True: a layout `bench run` can run on
        exactly `num_devices` processes (plan=auto); False: any layout of at most that many,
        possibly with the batch rounded to fit its data parallelism (then "global_batch_size"
        says which, kit.estimate.rounded_batch; compare such layouts per sample). `fixed`: options
        the search must keep (e.g. disttrain's placement); a search that cannot keep one refuses."""
        if self.sim_module is None:
            raise ConfigError(f"system {self.name!r} has no layout search; give its layout explicitly")
        found = importlib.import_module(self.sim_module).search(
            workload, num_devices, cluster, kit, seed=seed, global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size, exact=exact, fixed=fixed or {})
        if found is not None and "attention" in self.options:     # a system whose layers take one
            found["options"] = {"attention": simulated_attention(cluster), **found["options"]}
        return found

    # ---- profiling ---------------------------------------------------------------------------
    def profile_host(self, workload: Workload, processes: int, spawn) -> dict[str, Any] | None:
        """Optional: costs of this system's own step that the shared cost model does not price,
        measured on this CPU with `processes` local gloo processes; `spawn(worker, args, what)`
        runs worker(rank, port, *args, out_file) in each and returns the dict rank 0 wrote there.
        `bench profile` stores the result in the profile's "systems"/<name>, and this system's
        sim_module finds it in cluster.host["systems"]. None: nothing of its own."""
        return None

    @classmethod
    def has_cost_model(cls) -> bool:
        return cls.sim_module is not None or cls.simulate_step is not SystemAdapter.simulate_step


_REGISTRY: dict[str, type[SystemAdapter]] = {}


def register(cls: type[SystemAdapter]) -> type[SystemAdapter]:
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"system {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _discover() -> None:
    for info in pkgutil.iter_modules(systems.__path__):
        if info.name != "base" and not info.name.startswith("_"):
            importlib.import_module(f"systems.{info.name}")
    for name in filter(None, (p.strip() for p in os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"{PLUGINS_ENV} names {name!r}, which cannot be imported: {e}") from None


def system_names() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def baseline_names() -> list[str]:
    """The registered baselines, the default reference first."""
    _discover()
    return sorted((n for n, cls in _REGISTRY.items() if cls.baseline),
                  key=lambda n: (_REGISTRY[n].baseline_order, n))


def get_system(name: str) -> SystemAdapter:
    _discover()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown system {name!r}; choose one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


__all__ = ["MODULES", "ATTENTION", "attention_option", "ConfigError",
           "Layout", "OptimConfig", "TrainContext", "TimelineEvent", "StepOutput",
           "SimStep", "StepCost", "SystemAdapter", "register", "system_names", "baseline_names", "get_system"]
