"""The modules on several local processes at once, measured: at TP 2, and side by side.

TP 2: each module's forward + backward at TP 2 in two gloo processes, against the same
microbatches at TP 1 in a third process, in alternating passes. On a CPU a TP-2 module is far
from twice as fast: its collectives go through gloo, its non-GEMM work (norms, residuals,
dropout) is replicated on both ranks, and the two ranks wait for each other at every
collective. Measured on the 2-core machine this project runs on (small-enc-heavy): the
encoder ran *slower* at TP 2 than at TP 1. So the simulator's
measured-CPU cluster takes the speedup measured here (TP-1 seconds / TP-2 seconds per module,
collectives included) instead of FLOPs / 2 plus modelled collectives (bench.sim.costs.module_fb).
And two TP-2 groups side by side (4 processes; the colocated DistTrain runs' backbone at 2
cores), against one alone: each rank of a pair waits at every collective for the other, and with
two busy processes per core its partner is often off-core then. The processor-sharing schedule,
which hands a waiting rank's core to the others, put two groups at 1.82-1.85x one alone from the
5 Dec early sweep's profiles; measured (diagnostic, 5 rounds): 1.94x on the backbone, and
1.76-1.92x and 1.84-1.92x in the profiles of the 5 Dec 04:22 and 06:41 sweeps, with the pairs
running free. The colocated runs' pairs do not run free: every module boundary is an all-gather
over all ranks, so each forward and each backward ends when the slower pair's does, and the pair
the scheduler favoured waits. So the pairs now wait for each other at the end of every module's
forward and backward (a store barrier, using no core while waiting). Measured both ways in the
same nine rounds right after the 5 Dec 06:41 sweep (small's backbone): 2.01x synchronized, 1.96x
free; the median of the rounds' own ratios 1.00. So the waits cost little, and the ~10% by which
colocated small's schedule still reads under its runs lies elsewhere. The simulator reads the
measured slowdown where a run has that arrangement (Cluster.side_by_side).

A TP-2 module is also timed the way a monolithic step runs it: Megatron chains the three
modules' forwards and runs one backward through them, where the passes above run each module on
its own with a detached input, as DistTrain's ranks do. On small-enc-heavy (5 Dec) every
module's TP-2 speedup read higher chained: in two diagnostics of seven rounds over 8
microbatches by 6-14% (encoder 0.90 against 0.85, backbone 1.24 against 1.13, generator 0.45
against 0.40; the whole chained pass at TP 2 took 0.91-0.93x the module-by-module one, at TP 1
1.01x), and in this profile's own rounds by 2-7% (0.80 / 0.78, 1.15 / 1.13, 0.43 / 0.40). So
each round also times both chained ("joint_speedup"), and the simulator gives a monolithic step
those (costs.module_fb(joint=True)). Megatron's TP 2 on small-enc-heavy, simulated 7-18% too
slow in the last two sweeps, read +6.3% with these speedups and +11.4% without in a check right
after (same runs, same profiles; its TP-1 control +9.2% either way), and +0.5% in the next full
sweep (5 Dec 09:48; +7.5% on the same profiles without them).

Side by side ("co-run"): as many independent TP-1 copies of the timing as the machine has cores,
at once, and twice as many, against one alone, in wall seconds. Processes on separate cores still
share caches and memory bandwidth (on a VM, possibly a physical core), and with every core busy
a process also waits for its core while other threads run (its helper threads, the kernel's,
other processes'). Measured on small (3 Dec), two copies took 1.01x the CPU seconds of one alone
but 1.09x its wall seconds; real training steps (megatron at world size 1, two processes)
1.01-1.04x and 1.06-1.12x. The runs' ranks likewise waited for a core 4-5% of each step with
one process per core, so the co-run is the wall-clock ratio, of the slowest copy (a step waits
for its slowest rank; it was the median copy's CPU seconds until then, and the 2-process runs
ran 10-20% slower than simulated). That co-run had the other copies of the profile (the ones
only the phase with two per core uses) idle beside it, each with its threads (gloo's loops)
waking and taking turns on the cores: on small and small-gen-heavy (5 Dec, diagnostics of seven
rounds) the slowest of two copies read 1.10-1.16x one alone with two idle copies beside them and
1.04-1.07x with none. A 2-process run has none: in one small-gen-heavy run (megatron DP 2) the
slower rank's schedule took 0.97-1.05x its priced work, where the simulator, at 1.12-1.21x,
read its steps 9-11% slow. So the co-run is also measured as a 2-process run has it ("sole":
`procs` copies and no other process of the profile), and the simulator takes that where a run
has no more processes than cores, linear to the co-run with idle copies beside at two processes
per core (Cluster.schedule_corun). Two processes per core cost more again: each switch between
them on a core refills its caches, so 4 copies on the 2 cores took 1.13-1.25x
(small) the CPU seconds of one alone. There the wall ratio is divided by the two processes' fair
share of a core (x2), which the simulator's processor sharing already gives. The simulator slows
compute by these factors with that many processes busy (bench.sim.schedule.contention): a
snapshot, like the profile's speed, which is why validation uses profiles taken before and after
the sweep.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.profile.comm import run_processes
from bench.profile.measure import Timer
from bench.speed import SpeedProbe, median_probe
from workloads.presets import MODULES

TP = 2
PROCESSES = 2 * TP + 1   # two TP groups (side by side in one phase) and the TP-1 process
MAX_CORUN = 8            # side-by-side copies at most (a big machine: the runs use few processes)
# Rounds of (alone, together, oversubscribed), the median of their own ratios. With three rounds,
# each phase rebuilding the modules (~20 s apart), the slowdown with two per core read 1.01-1.09
# in three profiles of small over 90 minutes and 1.24 the next morning, and the 4-process runs
# of small were 10-23% slower than simulated: the phases fell in different stretches of the
# machine's drift. Phases are now one pass each, seconds apart, and seven rounds outvote stretches.
CORUN_ROUNDS = 7
CORUN_MICROBATCHES = 4   # a pass: the first of the profile's microbatches (small: ~2 s alone)
# ... repeated to last at least this long alone: tiny's 4 microbatches take 0.08 s, and seven
# rounds of such passes read 1.16, 1.70 and 1.06 in three profiles of one sweep (5 Dec), whose
# module rates agreed within 5%.
CORUN_PASS_S = 1.0
# Probes (bench.speed.SpeedProbe, ~8 ms each) the copies of a phase time at once after its pass:
# the profile's probe time under as many processes as a run has ranks (probe_under_corun).
PHASE_PROBES = 3
# Rounds of (TP 1 pass, TP 2 pass) for the TP-2 speedup, the median of their own ratios (as the
# co-run's): each timed apart from the other, minutes apart, drifted with the machine. A TP-2
# pair in lockstep stalls whenever either rank loses its core, so its rounds scatter more than
# one process's: small-enc-heavy's encoder read 0.62-0.99 over five rounds of one profile (4 Dec),
# a median of five moving by ~0.1 from profile to profile. Nine rounds, ~3 s each there
# (five phases each, since the chained passes: ~40 s in all for small-enc-heavy).
TP_ROUNDS = 9


def _barrier(store, processes: int, tag: str) -> None:
    """Wait until all `processes` reached `tag` (a TCPStore barrier: a waiting process uses no core)."""
    if store.add(tag, 1) == processes:
        store.set(tag + "/open", "1")
    store.wait([tag + "/open"])


def _tp_worker(rank: int, port: int, workload: str, data_profile: str | None, seed: int, microbatches: int,
               data_root: str, num_samples: int, rounds: int, out_file: str) -> None:
    """Ranks 0 and 1 form one TP-2 group; rank 2 runs the same modules at TP 1, a world of its own;
    ranks 3 and 4 form a second TP-2 group. They take turns, `rounds` times: a pass of rank 2
    over the microbatches while the others wait at a store barrier (using no core), a pass of the
    first pair, then a pass of both pairs side by side, waiting for each other at the end of every
    module's forward and backward. Per pass and module: forward + backward wall seconds (the
    waits included) and the process's CPU seconds (gloo's threads too)."""
    import torch
    import torch.distributed as dist
    from bench.profile.measure import build_modules, init_single_process, load_microbatches, run_joint_pass, run_pass
    from workloads.presets import get_workload
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, PROCESSES, rank == 0)
    group = None if rank == TP else ("a" if rank < TP else "b")
    tp = 1 if group is None else TP
    if group:
        group_rank = rank if group == "a" else rank - TP - 1
        dist.init_process_group("gloo", store=dist.PrefixStore(f"tp-{group}", store), rank=group_rank, world_size=TP)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dev = torch.device("cpu")
    teardown = init_single_process(dev, tp=tp)
    passes, side, joint = [], [], []
    try:
        w = get_workload(workload, data_profile)
        batches, *_ = load_microbatches(w, seed, w.micro_batch_size, microbatches, Path(data_root), num_samples)
        built, timer = build_modules(w, dev, torch.float32, seed, tp), Timer(dev)
        for mb in batches:                       # warm-up (allocator, lazy inits)
            run_pass(built, mb, timer)
        for i, phase in enumerate(["tp1", "pair", "side", "tp1 joint", "pair joint"] * rounds):
            _barrier(store, PROCESSES, f"phase{i}")
            runs = {"tp1": group is None, "pair": group == "a", "side": group is not None}[phase.split()[0]]
            if not runs:
                continue
            rec = {n: {"fwd": [], "bwd": [], "cpu": []} for n in MODULES}
            if phase.endswith("joint"):          # the modules chained, one backward: as Megatron runs a microbatch
                for mb in batches:
                    run_joint_pass(built, mb, timer, rec)
                joint.append({n: {"wall": sum(rec[n]["fwd"]) + sum(rec[n]["bwd"])} for n in MODULES})
                continue
            syncs = itertools.count()
            # side by side, the pairs wait for each other at every module's forward and backward end,
            # as colocated ranks do at their boundary all-gathers
            sync = (lambda: _barrier(store, 2 * TP, f"phase{i}/{next(syncs)}")) if phase == "side" else None
            for mb in batches:
                run_pass(built, mb, timer, rec, sync=sync)
            (side if phase == "side" else passes).append(
                {n: {"wall": sum(rec[n]["fwd"]) + sum(rec[n]["bwd"]), "cpu": sum(rec[n]["cpu"])} for n in MODULES})
        # Leave together: the TP-1 process, done after the last round's TP-1 pass, exited during the
        # pair's last pass (interpreter teardown on a core they needed), and that round's ratio read
        # low in all ten module rows of five profiles on 4 Dec (encoder 0.49-0.56, the others 0.61-0.97).
        _barrier(store, PROCESSES, "done")
        Path(f"{out_file}.{rank}").write_text(json.dumps({"passes": passes, "side": side, "joint": joint}))
    finally:
        teardown()
        dist.destroy_process_group()


def _lockstep_ratios(pair: list[list[dict]], alone: list[dict], module: str):
    """Per round: the TP-1 seconds, the pair's (the slower rank's: the pair is in lockstep), TP-1 / TP-2."""
    t2 = [max(rank[i][module]["wall"] for rank in pair) for i in range(len(alone))]
    t1 = [a[module]["wall"] for a in alone]
    return t1, t2, [a / b for a, b in zip(t1, t2) if a > 0 and b > 0] or [1.0]


def tp_speedups(pair: list[list[dict]], alone: list[dict], side: list[list[dict]] | None = None,
                pair_joint: list[list[dict]] | None = None, alone_joint: list[dict] | None = None) -> dict:
    """Per module, from the TP-2 ranks' passes and the TP-1 process's (one per round, _tp_worker):
    "speedup" the median over the rounds of each round's TP-1 seconds / TP-2 seconds (the slower
    rank's: the pair is in lockstep), "rounds" those ratios, "seconds" and "tp1_seconds" medians,
    "cpu_seconds" each TP rank's over all rounds, "busy" the TP ranks' CPU / wall seconds (mean).
    With `side` (every rank's passes of both pairs side by side, synchronized at each module's
    forward and backward end, one per round): "side_by_side" the median over the rounds of the
    slowest rank's seconds there / the pair's alone that round, "side_by_side_rounds" those ratios.
    With the joint passes (bench.profile.measure.run_joint_pass, one per round): "joint_speedup"
    and "joint_rounds", the same speedup with the modules chained as a monolithic step runs them."""
    rows = {}
    for n in MODULES:
        t1, t2, ratios = _lockstep_ratios(pair, alone, n)
        shares = [min(1.0, sum(p[n]["cpu"] for p in rank) / wall)
                  for rank in pair if (wall := sum(p[n]["wall"] for p in rank)) > 0]
        rows[n] = {"seconds": statistics.median(t2), "tp1_seconds": statistics.median(t1),
                   "speedup": statistics.median(ratios), "rounds": ratios,
                   "cpu_seconds": [float(sum(p[n]["cpu"] for p in rank)) for rank in pair],
                   "busy": float(statistics.mean(shares)) if shares else 1.0}
        if side:
            both = [max(rank[i][n]["wall"] for rank in side) for i in range(len(alone))]
            slow = [b / a for a, b in zip(t2, both) if a > 0 and b > 0] or [1.0]
            rows[n].update(side_by_side=statistics.median(slow), side_by_side_rounds=slow)
        if pair_joint and alone_joint:
            *_, joint = _lockstep_ratios(pair_joint, alone_joint, n)
            rows[n].update(joint_speedup=statistics.median(joint), joint_rounds=joint)
    return rows


def measure_tp(workload: str, data_profile: str | None, *, seed: int, microbatches: int, data_root: Path,
               num_samples: int, timeout: float = 600.0, rounds: int = TP_ROUNDS, **_) -> dict:
    """{"2": {module: tp_speedups' row}, "processes", "method"}: each module at TP 2 in two gloo
    processes against TP 1 in a third, in alternating passes (_tp_worker). "busy": the share of
    the wall time a TP rank spends on a core; the rest it waits at the collectives for the other
    rank, using no core, which the simulator's shared-core schedule must not charge as work."""
    count = min(microbatches, CORUN_MICROBATCHES)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tp.json"
        run_processes(_tp_worker, (workload, data_profile, seed, count, str(data_root), num_samples, rounds), out,
                      f"TP-{TP} module timing", nprocs=PROCESSES, timeout=timeout)
        raw = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(PROCESSES)]
    pairs = [r for r in range(PROCESSES) if r != TP]
    return {str(TP): tp_speedups([raw[r]["passes"] for r in range(TP)], raw[TP]["passes"],
                                 [raw[r]["side"] for r in pairs], [raw[r]["joint"] for r in range(TP)],
                                 raw[TP]["joint"]), "processes": TP, "side_by_side_groups": 2,
            "method": (f"each module's forward + backward over {count} microbatches at TP {TP} (megatron-core, "
                       f"gloo, {TP} local processes, one thread each) and at TP 1 (a third process), in "
                       f"{rounds} {'round' if rounds == 1 else 'rounds'} of alternating passes seconds apart (the "
                       f"machine's speed drifts: TP-1 and TP-2 timed minutes apart put small-enc-heavy's encoder at "
                       f"0.60 and 0.96 an hour apart); speedup = the median of each round's TP-1 / TP-2 wall seconds, "
                       f"collectives included; busy = process CPU seconds / wall seconds per TP rank, averaged; "
                       f"side_by_side = the median of each round's slowest rank with two TP-{TP} groups running at "
                       f"once ({2 * TP} processes, waiting for each other at the end of every module's forward "
                       f"and backward, as colocated ranks do) / the first group's seconds alone that round; "
                       f"joint_speedup = speedup with the modules chained and one backward (run_joint_pass), in "
                       f"two more phases of each round")}


class _ThreadTimer(Timer):
    """CPU seconds of the calling thread (a CPU-only timer: time_modules' forward/backward marks)."""
    def now(self) -> float:
        return time.thread_time()


def _corun_worker(rank: int, port: int, procs: int, total: int, workload: str, data_profile: str | None,
                  seed: int, microbatches: int, data_root: str, num_samples: int, rounds: int, out_file: str) -> None:
    """Rank 0 times the modules alone (the others wait at a store barrier, using no core), then
    `procs` copies at once (one per core), then, where `total` is more, all `total` (two per
    core), `rounds` times over. Each process builds its modules once and every phase is one
    pass, so a round's phases follow each other within seconds and the machine's drift (correlated over ~12 s) stays
    out of the round's ratios. Each pass records its wall seconds and the CPU seconds of its
    thread (corun_slowdowns); then, once every copy has passed a barrier, the phase's copies time
    the fixed work of bench.speed.SpeedProbe at once, as a run's ranks do after each step. Each
    process is its own world of 1; the store only orders the phases."""
    import torch
    import torch.distributed as dist
    from bench.profile.measure import build_modules, init_single_process, load_microbatches, run_pass
    from workloads.presets import get_workload
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, total, rank == 0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dev = torch.device("cpu")
    teardown = init_single_process(dev)
    runs = {"alone": 1, "together": procs, **({"oversubscribed": total} if total > procs else {})}
    times: dict[str, list[float]] = {phase: [] for phase in runs}
    cpu: dict[str, list[float]] = {phase: [] for phase in runs}
    probes: dict[str, list[dict]] = {phase: [] for phase in runs}
    try:
        w = get_workload(workload, data_profile)
        batches, *_ = load_microbatches(w, seed, w.micro_batch_size, microbatches, Path(data_root), num_samples)
        built, timer, probe = build_modules(w, dev, torch.float32, seed), _ThreadTimer(dev), SpeedProbe()
        for mb in batches:                       # warm-up (allocator, lazy inits), every process at once
            run_pass(built, mb, timer)
        _barrier(store, total, "size")
        if rank == 0:                            # how often a pass repeats the microbatches (CORUN_PASS_S)
            started = time.perf_counter()
            for mb in batches:
                run_pass(built, mb, timer)
            store.set("repeats", str(max(1, math.ceil(CORUN_PASS_S / (time.perf_counter() - started)))))
        repeats = int(store.get("repeats"))
        for i, phase in enumerate(list(runs) * rounds):
            _barrier(store, total, f"phase{i}")
            if rank >= runs[phase]:
                continue
            rec = {n: {"fwd": [], "bwd": [], "cpu": []} for n in MODULES}
            started = time.perf_counter()
            for mb in batches * repeats:
                run_pass(built, mb, timer, rec)
            times[phase].append(time.perf_counter() - started)
            cpu[phase].append(sum(sum(rec[n]["fwd"]) + sum(rec[n]["bwd"]) for n in MODULES))
            _barrier(store, runs[phase], f"probe{i}")
            probes[phase] += [t for t in (probe.run() for _ in range(PHASE_PROBES)) if t is not None]
        _barrier(store, total, "done")            # no copy exits while another still times a pass
        Path(f"{out_file}.{rank}").write_text(json.dumps({**times, "cpu": cpu, "probe": probes, "repeats": repeats}))
    finally:
        teardown()
        dist.destroy_process_group()


def corun_slowdowns(raw: list[dict], procs: int) -> dict:
    """Each rank's {"alone", "together", "oversubscribed" (where measured): wall seconds per round,
    "cpu": the same in CPU seconds} (only rank 0 runs alone) -> seconds (medians) and slowdowns:
    the median over the rounds of the round's slowest rank / the same round's alone, at least 1
    (below is noise). The slowest, because a training step waits for its slowest rank, and busy
    processes jitter apart: in rounds of real training steps side by side (small, 3 Dec) the
    slowest of 2 took 1.08-1.21x one alone where their median took 1.06-1.12x. Two per core: the
    wall ratio over the fair share's x2 (processor sharing). The CPU seconds' ratios ride along
    ("cpu_slowdown"), for comparison."""
    def slowdown(runs: list[dict], phase: str, share: float) -> tuple[float, float]:
        alone = runs[0]["alone"]
        rounds = [max(r[phase][i] for r in runs if len(r[phase]) > i) for i in range(len(alone))]
        ratios = [t / a / share for t, a in zip(rounds, alone) if a > 0] or [1.0]
        return statistics.median([t for r in runs for t in r[phase]]), max(1.0, statistics.median(ratios))
    cpu = [r["cpu"] for r in raw] if all("cpu" in r for r in raw) else None
    together = slowdown(raw, "together", 1.0)
    out = {"processes": procs, "seconds": together[0], "alone_seconds": statistics.median(raw[0]["alone"]),
           "slowdown": together[1]}
    if cpu:
        out["cpu_slowdown"] = slowdown(cpu, "together", 1.0)[1]
    if any(r.get("oversubscribed") for r in raw):
        over = slowdown(raw, "oversubscribed", 2.0)
        out["oversubscribed"] = {"processes": 2 * procs, "seconds": over[0], "slowdown": over[1]}
        if cpu:
            out["oversubscribed"]["cpu_slowdown"] = slowdown(cpu, "oversubscribed", 1.0)[1]
    return out


def probe_under_corun(raw: list[dict], procs: int) -> dict[str, dict]:
    """{copies at once: each kind's median probe CPU seconds over the rounds and the copies}, from
    _corun_worker's phases: 1 (alone), `procs` and 2 x `procs` (where measured)."""
    counts = {"alone": 1, "together": procs, "oversubscribed": 2 * procs}
    out = {str(n): median_probe([p for r in raw for p in (r.get("probe") or {}).get(phase, [])])
           for phase, n in counts.items()}
    return {n: kinds for n, kinds in out.items() if kinds}


def measure_corun(workload: str, data_profile: str | None, *, seed: int, microbatches: int,
                  data_root: Path, num_samples: int, timeout: float = 600.0, rounds: int = CORUN_ROUNDS,
                  **_) -> dict:
    """{"processes", "seconds", "alone_seconds", "slowdown", "cpu_slowdown", "oversubscribed":
    {"processes", "seconds", "slowdown", "cpu_slowdown"}, "sole": {"processes", "seconds",
    "alone_seconds", "slowdown", "cpu_slowdown"}, "probe_cpu_s", "method"}: wall seconds of one pass of the TP-1
    modules with `processes` (= the cores, at most MAX_CORUN) copies at once, and with twice as
    many, against one copy alone, in `rounds` rounds (_corun_worker), the copies not in a phase
    idle beside it; "sole": the same `processes` copies at once with no other copy on the machine
    (a launch of its own); slowdowns: corun_slowdowns; probe_cpu_s: probe_under_corun."""
    procs = max(1, min(os.cpu_count() or 1, MAX_CORUN))
    micro = min(microbatches, CORUN_MICROBATCHES)

    def launch(total: int) -> list[dict]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "corun.json"
            run_processes(_corun_worker, (procs, total, workload, data_profile, seed, micro, str(data_root),
                                          num_samples, rounds), out, "side-by-side module timing", nprocs=total,
                          timeout=timeout)
            return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(total)]
    raw = launch(2 * procs)
    sole = launch(procs)
    return {**corun_slowdowns(raw, procs), "pass_repeats": raw[0]["repeats"],
            "sole": corun_slowdowns(sole, procs), "probe_cpu_s": probe_under_corun(raw, procs),
            "method": (f"wall seconds of one pass over {micro} microbatches of the "
                       f"TP-1 modules' forwards and backwards (repeated pass_repeats times, to at least "
                       f"{CORUN_PASS_S:g} s alone), built once per process, alone (process 0), as {procs} "
                       f"copies at once (one per core) and as {2 * procs} (two per core, divided by 2: the fair share "
                       f"of a core), one thread each, {rounds} {'round' if rounds == 1 else 'rounds'} of adjacent "
                       f"phases, the copies not in a phase idle beside it; sole: the same with only the {procs} "
                       f"copies on the machine (alone and together, a launch of its own); the median over the "
                       f"rounds of each round's slowest copy / alone; below 1 (noise) counts as 1; cpu_slowdown: "
                       f"the same in CPU seconds (thread time), undivided; probe_cpu_s: after each phase's pass "
                       f"and a barrier, its copies time bench.speed.SpeedProbe {PHASE_PROBES} times at once, "
                       f"the median per kind by copies at once")}
