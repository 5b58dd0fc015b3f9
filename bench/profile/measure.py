"""Timing the modules, the optimizer and the data pipeline in one process (a gloo or nccl world of 1)."""
from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path

from bench.profile.fit import fit_affine
from bench.speed import SpeedProbe
from workloads.presets import MODULES


class Timer:
    def __init__(self, device):
        import torch
        self.cuda = device.type == "cuda"
        self.torch = torch

    def now(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter()


def init_single_process(device, tp: int = 1):
    """A gloo (or nccl) world of 1 (or the one already initialized, of `tp` processes) and megatron's
    parallel state at TP = `tp`, PP = 1; returns a teardown."""
    import torch
    import torch.distributed as dist
    created = False
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        created = True
    if device.type == "cpu":
        from systems import cpu_compat
        cpu_compat.install()
    else:
        torch.cuda.set_device(device)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    ps.initialize_model_parallel(tp, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)

    def teardown():
        ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
    return teardown


def _build(name, w, pg, dtype, device, seed, tp=1):
    from systems import mcore
    module, config = mcore.build_module(name, w, tp, 1, pg, dtype, seed, device)
    model = mcore.wrap_ddp(module, config, pg)
    return module, model, config


def load_microbatches(w, cfg_seed: int, mbs: int, count: int, data_root: Path, num_samples: int,
                      min_seconds: float = 0.0):
    """`count` collated microbatches of the dataset's first samples, with each sample's load
    seconds and each microbatch's collate seconds: medians over passes repeated for at least
    `min_seconds` (one pass at least). One pass takes a fraction of a second and so falls in one
    fast or slow stretch of a shared machine (tiny's mean load: 1.0 ms in one profile, 2.8 ms in
    the next); the median over passes is its typical speed, as for the modules (time_modules)."""
    from workloads.dataset import ensure_dataset
    from workloads.loader import DatasetReader, collate
    path = ensure_dataset(w, data_root, num_samples, cfg_seed)
    reader = DatasetReader(path, w, cfg_seed)
    reader.load_sample(0)                          # opens and indexes the shard (once per process)
    ids = list(range(min(count * mbs, len(reader))))
    loads, collates = [[] for _ in ids], []
    started = time.perf_counter()
    while not collates or time.perf_counter() - started < min_seconds:
        samples = []
        for i, times in zip(ids, loads):
            t0 = time.perf_counter()
            samples.append(reader.load_sample(i))
            times.append(time.perf_counter() - t0)
        groups = [samples[k:k + mbs] for k in range(0, len(samples) - mbs + 1, mbs)]
        mbs_out, times = [], []
        for g in groups:
            t0 = time.perf_counter()
            mbs_out.append(collate(g, w, cfg_seed))
            times.append(time.perf_counter() - t0)
        collates.append(times)
    load_times = [statistics.median(t) for t in loads]
    collate_times = [statistics.median(t) for t in zip(*collates)]
    metas = [reader.sample_meta(i) for i in ids]
    reader.close()
    return mbs_out, metas, load_times, collate_times, path


def _module_flops(w, name, mb_metas) -> float:
    from workloads.flops import sample_flops
    return float(sum(getattr(sample_flops(w, m.input_resolutions, m.output_resolutions), name) for m in mb_metas))


def _tokens(w, name, mb_metas) -> int:
    if name == "encoder":
        return sum(w.image_patches(r) for m in mb_metas for r in m.input_resolutions)
    if name == "backbone":
        return len(mb_metas) * w.backbone.seq_length
    return sum(w.latent_tokens(r) + w.generator.num_cond_tokens for m in mb_metas for r in m.output_resolutions)


def build_modules(w, device, dtype, seed, tp: int = 1) -> dict:
    """name -> (module, DDP-wrapped model, config) of each module, built as the trainers build it."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    pg = ProcessGroupCollection.use_mpu_process_groups()
    return {n: _build(n, w, pg, dtype, device, seed, tp) for n in MODULES}


def run_pass(built: dict, mb, timer, record=None, memory=None, sync=None) -> None:
    """One microbatch through encoder -> backbone -> generator, forward and backward, each module's
    input detached (as between ranks); `record`: per module, append forward / backward seconds and
    the process's CPU seconds; `memory`: per module, the bytes autograd saved for backward; `sync`:
    called at the end of each module's forward and of its backward, inside their times (processes
    that wait there for each other, as colocated ranks do at every module boundary)."""
    import torch
    for name in MODULES:
        _, model, _ = built[name]
        model.zero_grad_buffer()
        saved: dict[int, int] = {}

        def pack(t):
            try:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            except RuntimeError:
                pass
            return t
        hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if memory is not None
                 else contextlib.nullcontext())
        t0, c0 = timer.now(), time.process_time()
        with hooks:
            if name == "encoder":
                y = model(mb)
                loss = (y * 1e-3).sum()
                canvas = y.detach()
            elif name == "backbone":
                lm, cond = model(mb, canvas)
                loss = lm.sum() + (cond * 1e-3).sum()
                cond_in = cond.detach()
            else:
                loss = model(mb, cond_in).sum()
        if sync is not None:
            sync()
        t1 = timer.now()
        if loss.requires_grad:
            loss.backward()
        if sync is not None:
            sync()
        t2, c2 = timer.now(), time.process_time()
        if record is not None:
            record[name]["fwd"].append(t1 - t0)
            record[name]["bwd"].append(t2 - t1)
            record[name]["cpu"].append(c2 - c0)
        if memory is not None:
            memory[name] = sum(saved.values())


def run_joint_pass(built: dict, mb, timer, record=None) -> None:
    """One microbatch as a monolithic trainer runs it (Megatron's schedule): the three forwards
    chained, one backward from the summed losses. `record`: per module, forward and backward
    seconds; the backward is split where the gradient reaches the generator's conditioning and the
    encoder's output (tensor hooks). At TP 2 on this CPU the joint pass ran 7-9% faster than the
    same modules run one by one with detached inputs (run_pass), at TP 1 1% slower (5 Dec,
    small-enc-heavy), so a TP speedup is measured in the way the step it prices runs."""
    enc, llm, gen = (built[n][1] for n in MODULES)
    for model in (enc, llm, gen):
        model.zero_grad_buffer()
    marks: dict[str, float] = {}
    t0 = timer.now()
    canvas = enc(mb)
    t1 = timer.now()
    lm, cond = llm(mb, canvas)
    t2 = timer.now()
    loss = lm.sum() + gen(mb, cond).sum()
    t3 = timer.now()
    for key, t in (("generator", cond), ("backbone", canvas)):
        if t.requires_grad:               # an encoder without images this microbatch has no gradient
            t.register_hook(lambda _, key=key: marks.__setitem__(key, timer.now()))
    loss.backward()
    t4 = timer.now()
    gen_end = marks.get("generator", t3)
    llm_end = marks.get("backbone", t4)
    if record is not None:
        for name, fwd, bwd in (("encoder", t1 - t0, t4 - llm_end), ("backbone", t2 - t1, llm_end - gen_end),
                               ("generator", t3 - t2, gen_end - t3)):
            record[name]["fwd"].append(fwd)
            record[name]["bwd"].append(bwd)


def time_modules(w, mbs_list, metas, device, dtype, repeats, seed, timer, tp: int = 1, min_seconds: float = 0.0,
                 probes: list | None = None):
    """Per module and microbatch: median forward / backward seconds, forward + backward CPU seconds of
    the process (all its threads: gloo's too), activation memory, samples (at TP `tp`:
    every rank of the TP group calls this in lockstep). `metas`: the microbatches' samples in
    order (microbatches may differ in size). At least `repeats` passes, and more until the
    passes took `min_seconds`. `probes`: a list to append the machine's speed to after every pass
    (bench.speed.SpeedProbe's CPU seconds; nothing where it cannot probe: more than one thread)."""
    built = build_modules(w, device, dtype, seed, tp)
    out = {n: {"fwd": [], "bwd": [], "cpu": [], "mem": [], "flops": [], "tokens": [], "calls": [], "samples": []}
           for n in MODULES}
    mbs_dev = [mb.to(device) for mb in mbs_list]
    run_pass(built, mbs_dev[0], timer)           # warm-up (allocator, lazy inits)
    # Passes over all microbatches in training order, not one microbatch repeated back to back:
    # repeating the same microbatch measured ~7% faster on this CPU (its working set stays warm),
    # which a training step, running a different microbatch each time, never sees.
    memory = []
    for mb in mbs_dev:
        memory.append({})
        run_pass(built, mb, timer, memory=memory[-1])   # untimed: bytes saved for backward
    # A machine shared with others changes speed from second to second (the same pass of `tiny`
    # took 13.5-29.7 ms over two minutes, in runs of fast and slow stretches ~10 s long), so a few
    # passes catch one stretch; the median over `min_seconds` of passes is the machine's typical speed.
    passes = [{n: {"fwd": [], "bwd": [], "cpu": []} for n in MODULES} for _ in mbs_dev]
    probe = SpeedProbe() if probes is not None else None
    started, done = time.perf_counter(), 0
    while done < repeats or time.perf_counter() - started < min_seconds:
        for k, mb in enumerate(mbs_dev):
            run_pass(built, mb, timer, passes[k])
        done += 1
        if probe is not None and (times := probe.run()) is not None:
            probes.append(times)
    first = 0
    for k, mb in enumerate(mbs_dev):
        rec, mem = passes[k], memory[k]
        mb_metas, first = metas[first:first + mb.size], first + mb.size
        for n in MODULES:
            out[n]["fwd"].append(statistics.median(rec[n]["fwd"]))
            out[n]["bwd"].append(statistics.median(rec[n]["bwd"]))
            out[n]["cpu"].append(statistics.median(rec[n]["cpu"]))
            out[n]["mem"].append(mem[n])
            out[n]["flops"].append(_module_flops(w, n, mb_metas))
            out[n]["tokens"].append(_tokens(w, n, mb_metas))
            out[n]["calls"].append({"encoder": len(mb.image_groups), "backbone": 1,
                                    "generator": len(mb.latent_groups)}[n])
            out[n]["samples"].append(mb.size)
    params = {n: sum(p.numel() for p in built[n][0].parameters()) for n in MODULES}
    return out, params, built


def time_optimizer(built, repeats, timer) -> dict:
    """megatron distributed Adam per module at DP = 1, the way the runs call it: the step, and
    apart from it finish_grad_sync (the runs time them as two phases; at DP = 1 it is a
    reduce-scatter over a group of one, a copy of the gradient buffer: 0.04 s of 0.14 s for
    small-enc-heavy's 11.4M-parameter encoder on 4 Dec, which a larger group's measured
    collective replaces). Also on their own, the two passes clipping adds or takes away:
    megatron's step takes the gradient norm even unclipped (ChainedOptimizer.step), which a
    DistTrain module stepping on its own skips (systems.mcore.step_by_model_norm), and a clipped
    step scales the gradients by clip / norm (on 7 Dec, `small`: norm 1.6-3.4 ms, scaling
    2.1-5.8 ms, of steps of 15-59 ms)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from systems import mcore
    from systems.base import OptimConfig
    rows = []
    for name in MODULES:
        module, model, config = built[name]
        opt = mcore.build_optimizer([model], OptimConfig(), next(module.parameters()).dtype)
        times = {"step": [], "sync": [], "norm": [], "scale": []}

        def ready_gradients():
            for p in model.parameters():         # a non-zero gradient in the buffers
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad.fill_(1e-4)
            t0 = timer.now()
            model.finish_grad_sync()
            return t0

        for _ in range(repeats + 1):
            t0 = ready_gradients()
            t1 = timer.now()
            opt.step()
            times["sync"].append(t1 - t0)
            times["step"].append(timer.now() - t1)
            ready_gradients()
            opt.prepare_grads()
            t0 = timer.now()
            norm = opt.get_grad_norm()
            t1 = timer.now()
            for inner in getattr(opt, "chained_optimizers", [opt]):   # a factor below 1: the pass runs
                clip_grad_by_total_norm_fp32(inner.get_parameters(), max_norm=norm / 2, total_norm=norm)
            times["norm"].append(t1 - t0)
            times["scale"].append(timer.now() - t1)
        rows.append((name, sum(p.numel() for p in module.parameters()),
                     *(statistics.median(times[k][1:]) for k in ("step", "sync", "norm", "scale"))))
        del opt
    params = [r[1] for r in rows]

    def fit(column: int) -> dict:
        a, b, r2 = fit_affine(params, [r[column] for r in rows])
        return {"fixed_s": a, "s_per_param": b, "r2": r2}

    return {**fit(2), "grad_sync_dp1": fit(3), "grad_norm": fit(4), "clip_scale": fit(5),
            "points": [{"module": n, "params": p, "step_s": t, "grad_sync_s": g, "grad_norm_s": gn, "clip_scale_s": cs}
                       for n, p, t, g, gn, cs in rows],
            "method": "megatron DistributedOptimizer (Adam) step per module at DP = 1 (ChainedOptimizer.step, "
                      "unclipped: it takes the gradient norm), fitted as fixed + s_per_param x parameters; "
                      "grad_sync_dp1: finish_grad_sync at DP = 1 (a reduce-scatter over a group of one), "
                      "grad_norm: get_grad_norm, clip_scale: clip_grad_by_total_norm_fp32 at a factor of 1/2, "
                      "each fitted the same way"}

