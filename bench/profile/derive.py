"""Profiles for hardware that is not here: the datasheet peak times a measured (or default) efficiency."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from bench.profile.files import SCHEMA, hardware_key, load_profile, versions
from workloads.presets import MODULES


def derive_profile(workload: str, spec: str, efficiency_from: Path | str | None = None, dtype: str = "bf16",
                   data_profile: str | None = None) -> dict:
    """A profile for hardware that is not present: datasheet peak x a measured (or default) efficiency."""
    import numpy as np

    from bench.metrics import DEFAULT_EFFICIENCY, DEFAULT_EFFICIENCY_SOURCE, PEAK_FLOPS
    from workloads.dataset import plan_sample
    from workloads.flops import backbone_sample_flops, batch_flops
    from workloads.presets import get_workload
    if spec not in PEAK_FLOPS:
        raise ValueError(f"unknown --spec {spec!r}; choose one of {sorted(PEAK_FLOPS)}")
    w = get_workload(workload, data_profile)
    peak = PEAK_FLOPS[spec][dtype]
    if efficiency_from:
        src = load_profile(efficiency_from)
        eff = {n: min(1.0, float(src["modules"][n]["efficiency"])) for n in MODULES}
        source = (f"per-module efficiency measured on {src['hardware']['name']} ({src['hardware']['device']}, "
                  f"{src['workload']}, {src['date']}; {efficiency_from}), capped at 1, applied to the {spec} peak")
        derived_from = {"profile": str(efficiency_from), "hardware": src["hardware"]["name"],
                        "workload": src["workload"], "date": src["date"]}
    else:
        eff, source = dict(DEFAULT_EFFICIENCY), "default: " + DEFAULT_EFFICIENCY_SOURCE
        derived_from = {"default_efficiency": "bench.metrics.DEFAULT_EFFICIENCY"}
    # The mean sample of one global batch, drawn as the dataset generator draws it (seed 0).
    batch = w.global_batch_size
    total = batch_flops(w, [plan_sample(w, np.random.default_rng([0, 1, i]), i) for i in range(batch)])
    per_sample = {"encoder": total.encoder / batch, "generator": total.generator / batch,
                  "backbone": float(backbone_sample_flops(w))}
    modules = {}
    for n in MODULES:
        layers = getattr(w, n).num_layers
        flops = per_sample[n] * w.micro_batch_size
        t = flops / (peak * eff[n])
        modules[n] = {"layers": layers, "flops_per_microbatch": flops, "efficiency": eff[n],
                      "achieved_flops": peak * eff[n], "forward_s": t / 3, "backward_s": 2 * t / 3,
                      "forward_s_per_layer": t / 3 / layers, "backward_s_per_layer": 2 * t / 3 / layers,
                      "overhead_s": 0.0, "rate_flops": peak * eff[n]}
    return {
        "schema": SCHEMA, "derived": True, "derived_from": derived_from, "workload": w.name,
        "data_profile": w.data_profile.name,
        "hardware": {"key": hardware_key(spec=spec), "device": "cuda", "name": spec, "spec": spec},
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "versions": versions(),
        "dtype": dtype, "micro_batch_size": w.micro_batch_size, "peak_flops": peak,
        "peak_flops_source": PEAK_FLOPS[spec]["source"] + f" ({dtype} dense)", "efficiency_source": source,
        "timing_method": "derived, not measured: time = model FLOPs of the mean microbatch / (peak x efficiency); "
                         "forward 1/3, backward 2/3",
        "modules": modules, "optimizer": None, "data": None, "comm": None,
    }
