"""Run configuration: typed, resolved before launch, written beside every result.

`--set key=value` overrides with dotted keys: run keys (`steps`, `data.reorder`, ...) are
checked against this dataclass, anything else must be an option the system declares. A system
option set to "auto" (e.g. `plan=auto`) is replaced here, before launch, by the options of the
layout the system's own search picks for this machine (bench.sim.auto); the layout records
that choice.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.heap import DEFAULT_HEAP, HEAP_CHOICES
from systems.base import ConfigError, Layout, OptimConfig, get_system
from workloads.presets import get_workload
from workloads.profiles import DATA_PROFILES

AUTO = "auto"
REORDER_CHOICES = ("none", "intra", "inter", "both")
PREPROCESS_CHOICES = ("colocated", "disaggregated")


@dataclass(frozen=True)
class DataConfig:
    profile: str = ""                  # empty: the workload's default data profile
    num_samples: int = 256             # dataset size on disk; batches cycle through it
    root: str = "data"
    preprocess: str = "colocated"      # in the trainer processes, or in separate workers
    reorder: str = "none"
    num_workers: int = 2               # disaggregated preprocessing workers
    prefetch: int = 4                  # microbatches buffered per trainer (backpressure)
    # A directory of the user's WebDataset shards (<key>.jpg|.jpeg|.png + <key>.txt), imported once
    # under `root` (workloads/webdataset.py) and trained on instead of generated data; empty: generated.
    webdataset: str = ""
    # With webdataset: the share of imported pairs that are generation targets (text-to-image).
    p_generation: float = DATA_PROFILES["packed"].p_generation


@dataclass(frozen=True)
class RunConfig:
    system: str
    workload: str
    nproc: int = 1
    steps: int = 5                     # measured steps
    warmup: int = 2
    seed: int = 1234
    dtype: str = "fp32"                # fp32 | bf16
    device: str = "cpu"                # cpu | cuda
    backend: str = ""                  # empty: gloo on cpu, nccl on cuda
    threads_per_proc: int = 1
    global_batch_size: int = 0         # 0: the workload's
    micro_batch_size: int = 0
    timeout_s: int = 900               # no progress this long ends the run (and a collective times out)
    # Fault injection for the failure tests, off when empty: KIND@RANK:STEP (FaultSpec).
    fault: str = ""
    # What the processes' C heap does with freed memory: keep it, as a GPU's caching allocator does
    # (the default), or release it to the OS, glibc's own (faulted in again the next step): bench.heap.
    host_heap: str = DEFAULT_HEAP
    # Seconds of 512x512 matmuls in each CPU peak FLOP/s measurement (run start and end, the MFU's
    # denominator); a GPU's peak is its datasheet's. The tests shorten it: it is ~1 s of a tiny launch.
    peak_flops_s: float = 0.5
    # Every rank times a fixed piece of work after every step, outside the step's timing (~8 ms and
    # 64 MiB of host memory a rank; bench.speed.SpeedProbe): the machine's speed, which the report
    # brings comparisons to one of. false: no probe (the run then has no speed to be brought from).
    speed_probe: bool = True
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    options: dict[str, Any] = field(default_factory=dict)   # system options (tp, pp, plan, ...)
    tags: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        d = dict(d)
        d["data"] = DataConfig(**d.get("data", {}))
        d["optim"] = OptimConfig(**d.get("optim", {}))
        return cls(**d)


@dataclass(frozen=True)
class FaultSpec:
    """`--set fault=KIND@RANK:STEP`: at the start of step STEP (numbered as records number
    steps: from 0, warm-up included) rank RANK kills itself (kill: SIGKILL), stops itself
    (stop: SIGSTOP), exits (exit: code 3), or trains on non-finite data (nan). Applied by
    bench.run.faults in the worker, the same way for every system."""
    kind: str
    rank: int
    step: int

    KINDS = ("kill", "stop", "exit", "nan")

    @classmethod
    def parse(cls, text: str) -> "FaultSpec | None":
        if not text:
            return None
        kind, _, where = str(text).partition("@")
        rank, _, step = where.partition(":")
        if kind not in cls.KINDS or not rank.isdigit() or not step.isdigit():
            raise ConfigError(f"fault={text!r}: write KIND@RANK:STEP with KIND one of {cls.KINDS}, "
                              f"e.g. fault=kill@1:2")
        return cls(kind, int(rank), int(step))


def _coerce(name: str, value: Any, default: Any) -> Any:
    if isinstance(default, bool):          # `--set overlap=false` arrives as text, and bool("false") is True
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r}: give true or false")
        return value
    if default is None:
        return value
    try:
        return type(default)(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a valid {type(default).__name__}") from None


def resolve(system: str, workload: str, nproc: int, sets: dict[str, Any],
            tags: dict[str, str] | None = None) -> tuple[RunConfig, Layout]:
    """The fully resolved config and the validated layout, or a ConfigError; no processes."""
    adapter = get_system(system)
    try:
        wl = get_workload(workload)
    except KeyError as e:
        raise ConfigError(e.args[0]) from None
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    base = RunConfig(system=system, workload=workload, nproc=nproc).to_dict()
    options = dict(adapter.options)
    for key, value in sets.items():
        head, _, tail = key.partition(".")
        if tail and head in ("data", "optim"):
            if tail not in base[head]:
                raise ConfigError(f"unknown key {key!r}; {head}.* keys are {sorted(base[head])}")
            base[head][tail] = _coerce(key, value, base[head][tail])
        elif key in base and key not in ("system", "workload", "nproc", "data", "optim", "options", "tags"):
            base[key] = _coerce(key, value, base[key])
        elif key in options:
            options[key] = value if value == AUTO else _coerce(key, value, options[key])
        else:
            raise ConfigError(f"unknown key {key!r} for system {system!r}; run keys: "
                              f"{sorted(k for k in base if k not in ('data', 'optim', 'options', 'tags'))}, "
                              f"data.*, optim.*, system options: {sorted(options) or 'none'}")
    base["options"] = options
    base["tags"] = dict(tags or {})
    if base["data"]["webdataset"]:
        # Absolute, so the record names the data and the cached import is keyed on one path;
        # imported pairs are packed like the `packed` profile, which is what records then say.
        base["data"]["webdataset"] = str(Path(base["data"]["webdataset"]).expanduser().resolve())
        base["data"]["profile"] = base["data"]["profile"] or "packed"
    if not base["data"]["profile"]:
        base["data"]["profile"] = wl.data_profile.name
    base["global_batch_size"] = base["global_batch_size"] or wl.global_batch_size
    base["micro_batch_size"] = base["micro_batch_size"] or wl.micro_batch_size
    base["backend"] = base["backend"] or ("nccl" if base["device"] == "cuda" else "gloo")
    _check(RunConfig.from_dict(base))
    workload = wl.with_profile(base["data"]["profile"])
    choice = None
    if AUTO in options.values():
        from bench.sim.auto import auto_options
        # What the user set beside "auto" is kept, or refused when the search cannot keep it
        # (the attention kernel is not the search's to choose).
        asked = {k: options[k] for k in sets if k in adapter.options and options[k] != AUTO}
        unkept = sorted(set(asked) - adapter.search_keeps - {"attention"})
        if unkept:
            keeps = ", ".join(sorted(adapter.search_keeps)) or "no option"
            raise ConfigError(f"{', '.join(f'{k}={asked[k]}' for k in unkept)} with auto: {system}'s layout "
                              f"search keeps {keeps} fixed; give the whole layout explicitly")
        fixed = {k: v for k, v in asked.items() if k in adapter.search_keeps}
        chosen, choice = auto_options(system, workload, nproc, base["global_batch_size"], base["micro_batch_size"],
                                      fixed=fixed, clip_grad=float(base["optim"].get("clip_grad", 0.0)))
        options = {**{k: v for k, v in options.items() if v != AUTO}, **chosen, **asked}
        base["options"] = options
    cfg = RunConfig.from_dict(base)
    adapter.check_run(cfg)
    layout = adapter.layout(cfg.options, cfg.nproc, workload, cfg.global_batch_size, cfg.micro_batch_size)
    if choice is not None:
        layout = dataclasses.replace(layout, details={**layout.details, "layout_choice": AUTO, "auto": choice})
    return cfg, layout


def _check(cfg: RunConfig) -> None:
    if cfg.data.reorder not in REORDER_CHOICES:
        raise ConfigError(f"data.reorder={cfg.data.reorder!r}; choose one of {REORDER_CHOICES}")
    if cfg.data.preprocess not in PREPROCESS_CHOICES:
        raise ConfigError(f"data.preprocess={cfg.data.preprocess!r}; choose one of {PREPROCESS_CHOICES}")
    if cfg.host_heap not in HEAP_CHOICES:
        raise ConfigError(f"host_heap={cfg.host_heap!r}; choose one of {HEAP_CHOICES}")
    if not 0 < cfg.peak_flops_s <= 60:
        raise ConfigError(f"peak_flops_s={cfg.peak_flops_s} must be within (0, 60] seconds")
    if cfg.dtype not in ("fp32", "bf16"):
        raise ConfigError(f"dtype={cfg.dtype!r}; choose fp32 or bf16")
    if cfg.device not in ("cpu", "cuda"):
        raise ConfigError(f"device={cfg.device!r}; choose cpu or cuda")
    if cfg.steps < 1 or cfg.warmup < 0:
        raise ConfigError(f"steps must be >= 1 and warmup >= 0 (got steps={cfg.steps}, warmup={cfg.warmup})")
    for key, value, least in (("global_batch_size", cfg.global_batch_size, 1),
                              ("micro_batch_size", cfg.micro_batch_size, 1),
                              ("threads_per_proc", cfg.threads_per_proc, 1), ("timeout_s", cfg.timeout_s, 1),
                              ("data.num_samples", cfg.data.num_samples, 1), ("data.prefetch", cfg.data.prefetch, 0),
                              ("seed", cfg.seed, 0), ("optim.clip_grad", cfg.optim.clip_grad, 0)):
        if value < least:
            raise ConfigError(f"{key}={value} must be >= {least}")
    if cfg.data.preprocess == "disaggregated" and cfg.data.num_workers < 1:
        raise ConfigError(f"data.num_workers={cfg.data.num_workers}: disaggregated preprocessing needs at least "
                          f"1 worker")
    if cfg.backend not in ("gloo", "nccl") or (cfg.backend == "nccl" and cfg.device != "cuda"):
        raise ConfigError(f"backend={cfg.backend!r} with device={cfg.device}: choose gloo (cpu or cuda) or nccl (cuda)")
    if cfg.global_batch_size % cfg.micro_batch_size:
        raise ConfigError(f"global_batch_size {cfg.global_batch_size} is not a multiple of "
                          f"micro_batch_size {cfg.micro_batch_size}")
    fault = FaultSpec.parse(cfg.fault)
    if fault and (fault.rank >= cfg.nproc or fault.step >= cfg.warmup + cfg.steps):
        raise ConfigError(f"fault={cfg.fault!r}: rank must be < --nproc {cfg.nproc} and step < warmup + steps "
                          f"= {cfg.warmup + cfg.steps} (steps are numbered from 0)")
    if cfg.data.profile not in DATA_PROFILES:
        raise ConfigError(f"unknown data profile {cfg.data.profile!r}; choose one of {sorted(DATA_PROFILES)}")
    if cfg.data.webdataset and cfg.data.profile != "packed":
        raise ConfigError(f"data.webdataset packs image-caption pairs as the packed profile does; "
                          f"data.profile={cfg.data.profile!r} does not apply (leave it unset)")
    if not 0.0 <= cfg.data.p_generation <= 1.0:
        raise ConfigError(f"data.p_generation={cfg.data.p_generation} must be within [0, 1]")
    if cfg.data.p_generation != DataConfig.p_generation and not cfg.data.webdataset:
        raise ConfigError("data.p_generation applies to data.webdataset only (a profile sets it for generated data)")


# Fields added after repeats had been recorded, with the value every earlier run had: at that
# value a config's key leaves them out, so those repeats keep their config_key (glibc's heap
# released, the default peak measurement, the speed probe on). A kept heap, the default since
# 8 Dec, is keyed: its runs are not repeats of the earlier ones.
KEYED_ONLY_OFF_DEFAULT = {"host_heap": "release", "peak_flops_s": RunConfig.peak_flops_s, "speed_probe": True}


def config_key(config: RunConfig | dict) -> str:
    """What ties the repeats of one configuration together: a hash of the resolved config
    without its tags (which say why it ran, not what ran)."""
    d = config.to_dict() if isinstance(config, RunConfig) else dict(config)
    d.pop("tags", None)
    if not d.get("fault"):
        d.pop("fault", None)          # added later: runs without a fault keep their config_key
    for name, before in KEYED_ONLY_OFF_DEFAULT.items():
        if d.get(name, before) == before:
            d.pop(name, None)
    try:
        adapter = get_system(d["system"])
    except (ConfigError, KeyError):   # a record of a system this process does not know
        adapter = None
    skipped = {k for k in getattr(adapter, "key_skips_defaults", ()) if d["options"].get(k) == adapter.options.get(k)}
    d["options"] = {k: v for k, v in d["options"].items() if k not in skipped}
    if not d.get("data", {}).get("webdataset"):
        # Generated data: hash the keys that existed before data.webdataset, so repeats recorded
        # earlier keep their config_key.
        d["data"] = {k: v for k, v in d["data"].items() if k not in ("webdataset", "p_generation")}
    return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def dumps(cfg: RunConfig) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)
