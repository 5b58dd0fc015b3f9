"""python -m bench simulate: one simulated configuration -> one record (mode "simulated").

    python -m bench simulate --system disttrain --workload mllm-72b --gpus 1172 [--cluster h100]
        [--layout auto | LABEL | '{"tp": 8, ...}']
        [--set seed=0 --set num_batches=2 --set reorder=true --set global_batch_size=1024 ...]
        [--set profile=packed  (or data.profile=packed, as for `bench run`)]
        [--set tp=8 --set pp=10 ...  (the system's own options, as for `bench run`)]

--layout: auto (the system's own layout search), a layout label exactly as records and
figures show it (tp8-pp10-dp12, zero3-dp8-rc, enc:1x4,llm:8x10x12,gen:1x4, ...: the system
parses its own labels), or a JSON object of the system's options; `--set` options apply on top
(with auto, the search keeps them: `--layout auto --set placement=colocated` for disttrain).

--cluster: h100 | h200 (datasheet clusters; a GPU profiled in bench/sim/gpu_profiles/ uses its measured
efficiencies and GEMM table, bench.sim.gpu_profile), `cpu` (this machine: its profile for the workload
under results/profiles/ if there is one, else documented CPU defaults), or `cpu-profile FILE` /
a profile file path (a measured CPU profile -> this CPU with N processes; a derived or GPU
profile -> that GPU's cluster with the profile's efficiency). Every assumption goes into the
record; the summary line says "(simulated)". Bad input: one line on stderr, exit 2, nothing
appended. A layout that does not fit in memory is appended as a skipped record (exit 1).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SETTABLE = {"seed": int, "num_batches": int, "reorder": bool, "global_batch_size": int, "micro_batch_size": int,
            "profile": str, "clip_grad": float}
# `bench run` spells these data.profile and optim.clip_grad; accept those spellings here too.
ALIASES = {"data.profile": "profile", "optim.clip_grad": "clip_grad"}


class InputError(ValueError):
    pass


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="simulate one system on a cluster and append a simulated record")
    p.add_argument("--system", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--gpus", type=int, required=True, help="devices in the simulated cluster")
    p.add_argument("--cluster", nargs="+", default=["h100"], metavar="CLUSTER",
                   help="h100 | h200 | cpu | cpu-profile FILE | FILE (a bench profile JSON)")
    p.add_argument("--layout", default="auto",
                   help="auto (the system's own layout search), a layout label, or a JSON object of options")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help=f"simulation settings ({', '.join(sorted(SETTABLE))}) or the system's options")
    p.add_argument("--tag", dest="tags", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--results", type=Path, default=None, help="JSONL file records are appended to")
    p.set_defaults(handler=handle)


def _bool(v) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("1", "true", "yes", "on"):
        return True
    if str(v).lower() in ("0", "false", "no", "off"):
        return False
    raise InputError(f"expected true/false, got {v!r}")


def parse_sets(items: list[str], system_options: dict) -> tuple[dict, dict]:
    """(simulation settings, system options) from --set items."""
    from bench.keyvalue import parse_value
    settings, options = {}, {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = ALIASES.get(key.strip(), key.strip()), value.strip()
        if not sep or not key or not value:
            raise InputError(f"malformed --set {item!r}: write key=value, e.g. --set seed=1")
        if key in system_options:
            options[key] = parse_value(value)
            continue
        if key not in SETTABLE:
            raise InputError(f"unknown --set key {key!r}; choose one of {sorted(SETTABLE)} "
                             f"or the system's options {sorted(system_options)}")
        kind = SETTABLE[key]
        try:
            settings[key] = _bool(value) if kind is bool else kind(value)
        except ValueError:
            raise InputError(f"--set {key}={value!r} is not a valid {kind.__name__}") from None
    return settings, options


def parse_layout(adapter, text: str, options: dict) -> dict | str:
    """'auto', a JSON object of options, or a label the system parses; `options` (--set) on top."""
    from systems.base import ConfigError
    text = text.strip()
    if text == "auto":
        return "auto"              # with --set options: the search keeps them (simulate_record's fixed)
    if text.startswith("{"):
        try:
            layout = json.loads(text)
        except ValueError as e:
            raise InputError(f"--layout is not valid JSON: {e}") from None
        if not isinstance(layout, dict):
            raise InputError("--layout JSON must be an object of the system's options")
    else:
        try:
            layout = adapter.options_from_label(text)
        except ConfigError as e:
            raise InputError(f"--layout: {e}") from None
    return {**layout, **options}


def build_cluster(spec: list[str], workload: str, gpus: int):
    from bench.profile.profiler import find_profile, load_profile
    from bench.sim.cluster import CLUSTERS, cluster_from_profile, cpu_cluster, get_cluster
    from workloads.presets import get_workload
    name = spec[0]
    if len(spec) > 2 or (len(spec) == 2 and name != "cpu-profile"):
        raise InputError(f"--cluster {' '.join(spec)!r}: write h100, h200, cpu, or cpu-profile FILE")
    if name in CLUSTERS and len(spec) == 1:       # the GPU's measured profile, if bench/sim/gpu_profiles/ has one
        try:
            return get_cluster(name, get_workload(workload)), None
        except ValueError as e:
            raise InputError(f"--cluster {name}: {e}") from None
    if name == "cpu" and len(spec) == 1:
        path = find_profile(workload, "cpu")
        return cpu_cluster(gpus, profile=load_profile(path) if path else None), path
    path = Path(spec[1] if name == "cpu-profile" else name)
    if name == "cpu-profile" and len(spec) != 2:
        raise InputError("--cluster cpu-profile needs a profile file: --cluster cpu-profile FILE")
    if not path.is_file():
        raise InputError(f"--cluster: unknown cluster or missing profile file {str(path)!r}; "
                         f"choose one of {sorted(CLUSTERS)}, cpu, or cpu-profile FILE")
    try:
        return cluster_from_profile(load_profile(path), processes=gpus), path
    except (ValueError, KeyError) as e:
        raise InputError(f"--cluster: {e}") from None


def run(args) -> dict:
    """Validate everything, then simulate; returns the record (not yet appended)."""
    from bench.keyvalue import parse_sets as parse_tags
    from bench.sim.simulate import resolve_layout, simulate_record
    from systems.base import ConfigError, get_system
    from workloads.presets import PRESETS, get_workload
    try:
        adapter = get_system(args.system)
    except ConfigError as e:
        raise InputError(str(e)) from None
    if not adapter.has_cost_model():
        raise InputError(f"system {args.system!r} has no cost model (SystemAdapter.simulate_step or sim_module): "
                         f"it can be run, not simulated")
    if args.workload not in PRESETS:
        raise InputError(f"unknown workload {args.workload!r}; choose one of {sorted(PRESETS)}")
    if args.gpus < 1:
        raise InputError(f"--gpus must be >= 1, got {args.gpus}")
    sets, set_options = parse_sets(args.sets, adapter.options)
    try:
        tags = {k: str(v) for k, v in parse_tags(args.tags).items()}
    except ConfigError as e:
        raise InputError(str(e).replace("--set", "--tag")) from None
    try:
        w = get_workload(args.workload, sets.get("profile"))
    except KeyError as e:
        raise InputError(e.args[0]) from None
    B = sets.get("global_batch_size", w.global_batch_size)
    mbs = sets.get("micro_batch_size", w.micro_batch_size)
    if not 0.0 <= sets.get("clip_grad", 0.0) < float("inf"):       # NaN fails too
        raise InputError(f"--set clip_grad={sets['clip_grad']} must be a finite number >= 0 (0: no clipping)")
    if B < 1 or mbs < 1 or B % mbs:
        raise InputError(f"global_batch_size {B} must be a positive multiple of micro_batch_size {mbs}")
    options = parse_layout(adapter, args.layout, set_options)
    if options == "auto" and set(set_options) - adapter.search_keeps:
        keeps = f"only {', '.join(sorted(adapter.search_keeps))}" if adapter.search_keeps else "no option"
        raise InputError(f"--layout auto with --set {', '.join(sorted(set(set_options) - adapter.search_keeps))}: "
                         f"{args.system}'s layout search keeps {keeps} fixed; give the layout explicitly")
    cluster, profile_path = build_cluster(args.cluster, args.workload, args.gpus)
    if options != "auto":
        try:
            resolve_layout(w, args.system, options, args.gpus, B, mbs)
        except (ConfigError, KeyError, TypeError) as e:
            raise InputError(f"--layout: {e}") from None
    if profile_path is not None:
        tags.setdefault("cluster_profile", str(profile_path))
    return simulate_record(args.workload, args.system, args.gpus, cluster, options, seed=sets.get("seed", 0),
                           num_batches=sets.get("num_batches", 2), reorder=sets.get("reorder"),
                           profile=sets.get("profile"), global_batch_size=B, micro_batch_size=mbs, tags=tags,
                           fixed=set_options if options == "auto" else None, clip_grad=sets.get("clip_grad", 0.0))


def summary(record: dict) -> str:
    from bench.records import run_variant
    m, lay = record["metrics"], record["layout"]
    head = (f"[simulate] {record['system']} {record['workload']} on {record['num_devices']} x "
            f"{record['assumptions']['gpu']} ({record['config']['cluster']}) (simulated): {lay.get('label')}"
            f"{run_variant(clip_grad=record['config'].get('clip_grad'))}")
    if record["status"] != "ok":
        return f"{head}: {record['status']} ({record['reason']})"
    return (f"{head} ({record['config']['layout_choice']}), iteration {m['iteration_time_s']:.4g} s, "
            f"{m['samples_per_s']:.4g} samples/s, MFU {100 * m['mfu']:.1f}%, bubble {100 * m['bubble_fraction']:.1f}%, "
            f"{m['per_gpu_memory_gib']:.1f} GiB/device")


def handle(args, results_path) -> int:
    from bench.records import append_record
    try:
        record = run(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    append_record(record, results_path)
    print(summary(record) + f" -> {results_path}")
    return 0 if record["status"] == "ok" else 1
