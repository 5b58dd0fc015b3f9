"""analysis/: frames from records, every figure, the report, refusal of malformed records."""
from __future__ import annotations

import json
import math
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from analysis import load as load_mod  # noqa: E402
from analysis.__main__ import main  # noqa: E402
from analysis.figures import FIGURES, NoData, draw_all  # noqa: E402
from analysis.report import write_report  # noqa: E402
from analysis.repeats import best_layouts, configurations  # noqa: E402
from analysis.style import system_palette  # noqa: E402
from bench.records import build_record  # noqa: E402
from systems.base import baseline_names, system_names  # noqa: E402

SYSTEM_SPEED = {"megatron": 1.0, "deepspeed": 0.9, "disttrain": 1.45}
LAYOUTS = {"megatron": ["tp1-pp1-dp{n}", "tp2-pp1-dp{h}"], "deepspeed": ["zero2-dp{n}"],
           "disttrain": ["enc:1x1,llm:1x1x{h},gen:1x1"]}


def _timeline(ranks: int, busy_share: float) -> list[dict]:
    out, t = [], 0.0
    for r in range(ranks):
        t = 0.02 * r
        for module in ("encoder", "backbone", "generator"):
            for kind, dur in (("fwd", 0.05), ("bwd", 0.09)):
                out.append({"rank": r, "module": module, "kind": kind, "start_s": t,
                            "end_s": t + dur * busy_share})
                t += dur
        out.append({"rank": r, "module": "backbone", "kind": "comm", "start_s": t, "end_s": t + 0.03})
    return out


def _steps(n: int, speed: float, ranks: int, seed: int, timeline: bool = True) -> list[dict]:
    steps = []
    for i in range(n):
        lm = 6.0 * math.exp(-i / 12) + 1.5 + 0.01 * ((seed * 7 + i) % 3)
        gen = 0.9 * math.exp(-i / 20) + 0.2
        step = {"step": i, "latency_s": 1.0 / speed, "loss": lm + gen, "lm_loss": lm,
                "gen_loss": gen, "data_wait_s": 0.05,
                "rank_busy_s": [0.8 / speed] * ranks, "rank_idle_s": [0.2 / speed] * ranks}
        if timeline and i == n - 1:
            step["timeline"] = _timeline(ranks, min(speed, 1.0))
        steps.append(step)
    return steps


def _metrics(sps: float, n: int, **extra) -> dict:
    mfu = 0.02 * sps / n
    return {"samples_per_s": sps, "tokens_per_s": sps * 512, "samples_per_s_per_device": sps / n,
            "tokens_per_s_per_device": sps * 512 / n, "mfu": mfu,
            "mfu_per_module": {"encoder": mfu * 0.2, "backbone": mfu * 0.6, "generator": mfu * 0.2},
            **extra}


def _record(i, system, workload, n, *, mode="measured", status="ok", layout=None, exp="main",
            speed=None, data=None, tags=None, extra=None, timeline=True):
    speed = SYSTEM_SPEED[system] if speed is None else speed
    label = layout or LAYOUTS[system][0].format(n=n, h=max(n // 2, 1))
    base = {"tiny": 8.0, "small": 3.0, "mllm-9b": 40.0, "mllm-15b": 25.0, "mllm-72b": 6.0, "long-64k": 4.0}[workload]
    kw = dict(run_id=f"r{i:03d}", system=system, workload=workload, data_profile="heterogeneous",
              status=status, layout={"label": label}, num_devices=n, mode=mode, env={},
              config={"data": data or {"reorder": "none", "preprocess": "colocated"},
                      **({"cluster": "h100-ib"} if mode == "simulated" else {"device": "cpu"})},
              tags={"experiment": exp, **(tags or {})})
    if status != "ok":
        return build_record(**kw, reason=f"{system} {status}: out of memory | at step 3")
    if mode == "simulated":
        return build_record(**kw, assumptions={"cost_model": "roofline"},
                            metrics=_metrics(base * speed * n / 64, n, iteration_time_s=1.0, **(extra or {})))
    return build_record(**kw, steps=_steps(20, speed, n, i, timeline),
                        metrics=_metrics(base * speed * n / 2, n, **(extra or {})))


def synthetic_records() -> list[dict]:
    recs, i = [], iter(range(1000))
    for system, layouts in LAYOUTS.items():
        for layout in layouts:  # main measured, two megatron layouts
            recs.append(_record(next(i), system, "tiny", 2, layout=layout.format(n=2, h=1),
                                speed=SYSTEM_SPEED[system] * (0.85 if "tp2" in layout else 1)))
        recs.append(_record(next(i), system, "small", 4, timeline=system != "megatron",
                            extra={"probe_cpu_s": {"gemm": 0.003, "dispatch": 0.002, "memory": 0.003}}))
        for n in (1, 4):
            recs.append(_record(next(i), system, "tiny", n, exp="scaling"))
        for workload in ("mllm-9b", "mllm-72b"):
            for n in (64, 128, 256):
                recs.append(_record(next(i), system, workload, n, mode="simulated", exp="scaling"))
    for plan, speed in (("auto", 1.45), ("naive", 1.1)):
        recs.append(_record(next(i), "disttrain", "small", 4, exp="orchestration", speed=speed,
                            tags={"plan_kind": plan}))
    for reorder, speed, imb in (("none", 1.2, 1.8), ("intra", 1.3, 1.4), ("inter", 1.35, 1.3),
                                ("both", 1.45, 1.1)):
        recs.append(_record(next(i), "disttrain", "small", 4, exp="reorder", speed=speed,
                            data={"reorder": reorder}, extra={"encoder_load_imbalance": imb}))
    for prep, speed, wait in (("colocated", 1.1, 0.3), ("disaggregated", 1.45, 0.02)):
        recs.append(_record(next(i), "disttrain", "small", 4, exp="preprocess", speed=speed,
                            data={"preprocess": prep}, extra={"data_wait_fraction": wait}))
    for pipeline, speed, bubble in (("plain", 1.2, 0.2), ("interleaved", 1.1, 0.25)):
        recs.append(_record(next(i), "disttrain", "small", 4, exp="interleaving", speed=speed,
                            tags={"pipeline": pipeline}, extra={"bubble_fraction": bubble}))
    for n in (64, 256):          # the three configurations of arXiv 2605.27678, simulated
        for system, configuration, speed in (("megatron", "homogeneous", 1.0), ("disttrain", "colocated", 1.3),
                                             ("disttrain", "non-colocated", 1.1)):
            recs.append(_record(next(i), system, "long-64k", n, mode="simulated", exp="heterogeneous-sim",
                                speed=speed, tags={"configuration": configuration},
                                extra={"tflops_per_gpu": 300.0 * speed}))
    recs.append(_record(next(i), "deepspeed", "mllm-15b", 64, status="failed"))
    recs.append(_record(next(i), "megatron", "mllm-15b", 64, status="skipped"))
    return recs


def write_results(directory, records) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    half = len(records) // 2
    for name, chunk in (("a.jsonl", records[:half]), ("b.jsonl", records[half:])):
        (directory / name).write_text("".join(json.dumps(r) + "\n" for r in chunk))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("results")
    records = synthetic_records()
    write_results(d, records)
    return d, records


@pytest.fixture(scope="module")
def data(results):
    return load_mod.load(results[0])


@pytest.fixture(scope="module")
def megatron_report(results, tmp_path_factory):
    """`python -m analysis report --baseline megatron` of the synthetic records, the second file
    ending in a torn line (a write cut short), rendered once (every figure: ~9 s) for the tests
    that read it: (exit status, report.md)."""
    d, out = tmp_path_factory.mktemp("torn"), tmp_path_factory.mktemp("report")
    write_results(d, results[1])
    with (d / "b.jsonl").open("a") as f:
        f.write(json.dumps(_record(999, "megatron", "tiny", 2))[:80])
    status = main(["report", "--results", str(d), "--out", str(out), "--baseline", "megatron"])
    return status, out / "report.md"


def test_runs_frame_one_row_per_record(data, results):
    runs = data.runs
    assert len(runs) == len(results[1])
    assert set(load_mod.RUN_COLUMNS) <= set(runs.columns)
    assert {"metrics.samples_per_s", "layout.label", "tags.experiment"} <= set(runs.columns)
    assert set(runs["status"]) == {"ok", "failed", "skipped"}
    assert set(runs["mode"]) == {"measured", "simulated"}
    assert runs["source"].str.match(r"[ab]\.jsonl:\d+$").all()
    assert sorted(runs.loc[runs["experiment"] == "reorder", "reorder"]) == ["both", "inter", "intra", "none"]


def _tiny_speedups(runs, baseline) -> dict:
    best = best_layouts(runs, baseline=baseline)
    main_tiny = best[(best["workload"] == "tiny") & (best["num_devices"] == 2)]
    return main_tiny.set_index("system")["speedup"].to_dict()


def test_steps_frame_and_speedup(data, results):
    measured_ok = [r for r in results[1] if r["mode"] == "measured" and r["status"] == "ok"]
    assert len(data.steps) == sum(len(r["steps"]) for r in measured_ok)
    assert {"run_id", "system", "step", "loss", "lm_loss", "timeline"} <= set(data.steps.columns)
    # By default speedups divide by the first registered baseline that has a run.
    assert data.baseline == baseline_names()[0]
    speedups = _tiny_speedups(data.runs, data.baseline)
    base = SYSTEM_SPEED[data.baseline]
    assert speedups == pytest.approx({s: v / base for s, v in SYSTEM_SPEED.items()})


@pytest.mark.slow
def test_baseline_option_changes_the_speedup_reference(results, megatron_report, tmp_path, capsys):
    data = load_mod.load(results[0], baseline="megatron")
    assert data.baseline == "megatron"
    expected = {"megatron": 1.0, "deepspeed": 0.9, "disttrain": 1.45}
    assert _tiny_speedups(data.runs, data.baseline) == pytest.approx(expected)
    # Any system with a successful run may be the reference, not only a registered baseline.
    assert load_mod.load(results[0], baseline="disttrain").baseline == "disttrain"
    with pytest.raises(load_mod.BaselineError, match="nosuch"):
        load_mod.load(results[0], baseline="nosuch")
    status, report = megatron_report
    assert status == 0
    text = report.read_text()
    assert "speedup vs megatron" in text and "speedup vs deepspeed" not in text
    assert "### Speedup over megatron" in text and "(speedup.png)" in text
    capsys.readouterr()
    assert main(["report", "--results", str(results[0]), "--out", str(tmp_path / "o"), "--baseline", "nosuch"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nosuch" in err and "megatron" in err


UNIT = re.compile(r"\(.+\)")


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_figure_has_title_units_legend(data, name):
    fig = FIGURES[name](data)
    try:
        titles = [fig._suptitle.get_text() if fig._suptitle else ""] + [a.get_title() for a in fig.axes]
        assert any(t.strip() for t in titles)
        drawn = [a for a in fig.axes if a.has_data()]
        assert drawn
        labels = [a.get_ylabel() for a in drawn] + [a.get_xlabel() for a in drawn]
        assert all(UNIT.search(t) for t in labels if t), labels  # every label names its unit
        xlabels = [a.get_xlabel() for a in drawn] + [fig._supxlabel.get_text() if fig._supxlabel else ""]
        assert any(UNIT.search(t) for t in xlabels)
        assert UNIT.search(drawn[0].get_ylabel())
        assert fig.legends or any(a.get_legend() for a in fig.axes)
        assert fig.get_size_inches()[0] >= 6
    finally:
        plt.close(fig)


def test_simulated_is_labelled(data):
    for name in ("throughput", "scaling"):
        fig = FIGURES[name](data)
        texts = [a.get_title() for a in fig.axes] + [t.get_text() for lg in fig.legends for t in lg.get_texts()]
        assert any("simulated" in t for t in texts), name
        plt.close(fig)


def test_figure_without_data_is_skipped(tmp_path):
    d = tmp_path / "results"
    write_results(d, [_record(0, "disttrain", "tiny", 2)])
    data = load_mod.load(d)
    for name in ("speedup", "scaling", "orchestration", "reorder", "preprocess", "interleaving", "machine_speed"):
        with pytest.raises(NoData):
            FIGURES[name](data)
    outcomes = {o.name: o for o in draw_all(data, tmp_path / "out")}
    assert outcomes["speedup"].skipped and not (tmp_path / "out" / "speedup.png").exists()
    assert outcomes["throughput"].path.exists()


def test_timeline_falls_back_to_busy_idle_bars(tmp_path):
    d = tmp_path / "results"
    write_results(d, [_record(0, "megatron", "tiny", 2, timeline=False)])
    fig = FIGURES["timeline"](load_mod.load(d))
    assert any("bubble" in t.get_text() for lg in fig.legends for t in lg.get_texts())
    plt.close(fig)


@pytest.mark.slow
def test_report_written_and_references_existing_pngs(megatron_report):
    status, path = megatron_report
    out = path.parent
    assert status == 0
    text = path.read_text()
    pngs = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text)
    assert len(pngs) == len(FIGURES)  # every figure has data in the synthetic set
    assert all((out / p).is_file() and (out / p).stat().st_size > 5000 for p in pngs)
    assert "| system | workload | profile | layout | devices | mode |" in text
    assert "speedup vs megatron" in text and "1.45×" in text
    assert "**failed** `deepspeed`" in text and "**skipped** `megatron`" in text
    assert "out of memory \\| at step 3" in text  # a pipe in a reason does not break the table


@pytest.mark.slow
def test_cli_report(megatron_report, tmp_path):
    status, report = megatron_report
    assert status == 0 and report.is_file()
    assert main(["report", "--results", str(tmp_path / "empty")]) == 1


def test_bad_json_line_skipped_and_named(tmp_path):
    good = json.dumps(_record(0, "megatron", "tiny", 2))
    (tmp_path / "x.jsonl").write_text(good + "\n\n" + good + "\n{not json\n")
    data = load_mod.load(tmp_path)
    assert len(data.runs) == 2
    (bad,) = data.skipped
    assert bad.where.endswith("x.jsonl:4") and not bad.torn


@pytest.mark.slow
def test_report_from_a_file_with_a_torn_last_line_names_it(results, megatron_report):
    status, path = megatron_report
    recs, report = results[1], path.read_text()
    assert status == 0 and f"from {len(recs)} records" in report
    assert "1 line(s) of the results could not be read and were skipped" in report
    assert f"b.jsonl:{len(recs) - len(recs) // 2 + 1}: torn last line" in report
    assert "## Figures" in report and "*Skipped:" not in report.split("## Figures")[1].split("### Ablation")[0]


def test_headline_ratios_come_from_the_main_runs(data):
    from analysis.report import headline_section
    text = "\n".join(headline_section(data.runs))
    main = data.runs[(data.runs["experiment"] == "main") & (data.runs["workload"] == "small")]
    best = main.groupby("system")["samples_per_s"].max()
    assert "## Headline" in text
    assert f"disttrain vs megatron: {best['disttrain'] / best['megatron']:.2f}×" in text
    assert f"disttrain vs deepspeed: {best['disttrain'] / best['deepspeed']:.2f}×" in text


def _repeats(system, speeds, start, key, **record):
    """Measured records of one configuration, one per repeat (samples/s = 3 x speed each)."""
    out = []
    for k, speed in enumerate(speeds):
        r = _record(start + k, system, "small", 4, speed=speed, timeline=False, **record)
        r.update(config_key=key, repeat=k + 1)
        out.append(r)
    return out


def _windowed_repeats(system, first, second, start, key, rng):
    """Repeats measuring 1 warm-up + 10 steps, the first five at `first` s a step, the last five at
    `second` (each a number, or one per repeat; 2% noise a step), with the rates a run records (16
    samples over the median step)."""
    out = []
    for k in range(5):
        f, s = (x[k] if isinstance(x, (list, tuple)) else x for x in (first, second))
        lat = [*(f * (1 + 0.02 * rng.standard_normal(5))), *(s * (1 + 0.02 * rng.standard_normal(5)))]
        r = _repeats(system, [1.0], start + k, key)[0]
        r["steps"] = [{"step": 0, "warmup": True, "latency_s": 9.0, "loss": 6.0}] + [
            {"step": i + 1, "warmup": False, "latency_s": x, "loss": 6.0} for i, x in enumerate(lat)]
        r["metrics"].update(samples_per_s=16 / float(np.median(lat)), step_time_s=float(np.median(lat)))
        r["repeat"] = k + 1
        out.append(r)
    return out


def test_a_comparison_says_whether_its_verdict_holds_over_both_halves_of_the_steps(tmp_path):
    """Every repeat measures the same steps, so the interval cannot show a pattern within the runs:
    the headline gives the ratio over each half of the measured steps (warm-up left out) and says
    when the verdict differs between them."""
    rng = np.random.default_rng(5)
    recs = (_windowed_repeats("megatron", 1.0, 1.0, 0, "m", rng)
            + _windowed_repeats("disttrain", 0.7, 1.0, 10, "t", rng)        # faster early only
            + _windowed_repeats("deepspeed", 1.3, 1.3, 20, "d", rng))       # slower throughout
    write_results(tmp_path / "r", recs)
    runs = load_mod.load(tmp_path / "r").runs
    first, second = (runs[runs["system"] == "disttrain"][c] for c in ("samples_per_s_first_half",
                                                                         "samples_per_s_second_half"))
    assert np.median(first) == pytest.approx(16 / 0.7, rel=0.03) and np.median(second) == pytest.approx(16, rel=0.03)
    from analysis.report import headline_section
    text = "\n".join(headline_section(runs))
    vs_megatron = text.split("- disttrain vs megatron: ")[1].split("\n- ")[0]
    assert ", faster" in vs_megatron.split("\n")[0]                      # over all its steps
    assert "over the first / second half of each run's measured steps: 1.4" in vs_megatron
    assert "**the verdict differs between the halves**" in vs_megatron
    vs_deepspeed = text.split("- disttrain vs deepspeed: ")[1].split("\n- ")[0]
    assert "faster / 1.3" in vs_deepspeed and "the verdict holds over both halves" in vs_deepspeed
    # simulated records, and runs of fewer than 4 measured steps, have no halves
    assert all(math.isnan(x) for x in load_mod.half_rates({**recs[0], "mode": "simulated"}))
    assert not any(math.isnan(x) for x in load_mod.half_rates(recs[0]))
    assert all(math.isnan(x) for x in load_mod.half_rates({**recs[0], "steps": recs[0]["steps"][:4]}))


def test_halves_that_agree_with_each_other_but_not_with_the_whole_run_are_told_apart(tmp_path):
    """Repeats fast early and slow late, or the other way round: every run's median step is the
    same, so the whole run reads faster, while each half alone spreads too wide for a verdict."""
    rng = np.random.default_rng(7)
    swings = ([0.8, 1.1, 0.8, 1.1, 0.8], [1.1, 0.8, 1.1, 0.8, 1.1])
    write_results(tmp_path / "r", _windowed_repeats("megatron", 1.0, 1.0, 0, "m", rng)
                  + _windowed_repeats("disttrain", *swings, 10, "t", rng))
    from analysis.report import headline_section
    text = "\n".join(headline_section(load_mod.load(tmp_path / "r").runs))
    line = text.split("- disttrain vs megatron: ")[1]
    assert ", faster" in line.split("\n")[0]
    assert "both halves read alike, though not as the whole run does" in line.split("\n")[1]


def _probed_repeats(system, rate, machine, start, key, rng, **record):
    """Repeats of one configuration on a machine whose speed changes between runs: a run at
    `machine` (1 = the usual speed, 1.2 = its work takes 20% longer) takes that much more probe
    CPU time and records rate * machine^-0.8 samples/s (1% noise)."""
    out = _repeats(system, [rate / 3 * m ** -0.8 * (1 + 0.01 * rng.standard_normal()) for m in machine], start, key,
                   **record)
    for r, m in zip(out, machine):
        r["metrics"]["probe_cpu_s"] = {"gemm": 0.003 * m, "dispatch": 0.002 * m, "memory": 0.003 * m}
    return out


def test_a_comparison_at_one_speed_of_the_machine_measures_out_the_machines_drift(tmp_path):
    """disttrain is 1.10x megatron at any one speed of the machine, but its runs met the machine
    slower: the raw repeats cannot tell the two apart, the runs brought to one probe time can."""
    from analysis import speed
    from bench import speed as bench_speed
    from analysis.report import headline_section
    rng = np.random.default_rng(11)
    machine_m, machine_t = [0.8, 1.2, 0.9, 1.1, 1.0], [1.2, 0.8, 1.1, 0.9, 1.25]
    recs = _probed_repeats("megatron", 6.0, machine_m, 0, "m", rng) + _probed_repeats("disttrain", 6.6, machine_t, 10,
                                                                                      "t", rng)
    write_results(tmp_path / "r", recs)
    runs = load_mod.load(tmp_path / "r").runs
    assert runs["probe_s"].tolist() == pytest.approx([0.008 * m for m in machine_m + machine_t])
    fitted = speed.fit(runs, runs["config_key"])
    assert fitted.slope == pytest.approx(-0.8, abs=0.05) and fitted.r2 > 0.95 and fitted.runs == 10
    assert fitted.dof == 7 and fitted.told_from_zero
    # the same slope and standard error as least squares on a dummy per configuration
    design = np.column_stack([np.log(runs["probe_s"]), runs["config_key"] == "m", runs["config_key"] == "t"])
    y = np.log(runs["samples_per_s"])
    coef, rss, *_ = np.linalg.lstsq(design.astype(float), y, rcond=None)
    cov = rss[0] / 7 * np.linalg.inv(design.astype(float).T @ design.astype(float))
    assert fitted.slope == pytest.approx(coef[0]) and fitted.slope_se == pytest.approx(np.sqrt(cov[0, 0]))
    line = "\n".join(headline_section(runs)).split("- disttrain vs megatron: ")[1]
    assert "no difference beyond the noise" in line.split("\n")[0]
    at_speed = line.split("at one speed of the machine")[1].split("\n")[0]
    assert float(at_speed.split("): ")[1].split("×")[0]) == pytest.approx(1.1, abs=0.02) and ", faster" in at_speed
    assert "the fixed-work probe took 1.10× the CPU time during disttrain's runs" in at_speed
    assert "**the machine's speed changes the verdict**" in at_speed
    fig = FIGURES["machine_speed"](load_mod.load(tmp_path / "r"))       # the evidence, drawn
    title = fig.axes[0].get_title()
    assert title.startswith("main · small · 4 devices\nslope -0.") and len(fig.axes[0].lines) == 2
    plt.close(fig)
    # a slope needs 3 residual degrees of freedom (5 runs of 2 configurations leave 2)
    write_results(tmp_path / "five", recs[:3] + recs[5:7])
    five = load_mod.load(tmp_path / "five").runs
    assert speed.fit(five, five["config_key"]) is None
    # 3 + 3 repeats: a slope, but too few repeats for a 95% interval, so no line
    write_results(tmp_path / "few", recs[:3] + recs[5:8])
    few = load_mod.load(tmp_path / "few").runs
    assert speed.fit(few, few["config_key"]).dof == 3
    assert "  - at one speed of the machine (" not in "\n".join(headline_section(load_mod.load(tmp_path / "few").runs))
    # the probe itself slower during one side's runs, every time: it may time the systems, not the machine
    apart = (_probed_repeats("megatron", 6.0, [0.8, 0.85, 0.9, 0.95, 1.0], 0, "m", rng)
             + _probed_repeats("disttrain", 6.6, [1.1, 1.15, 1.2, 1.25, 1.3], 10, "t", rng))
    write_results(tmp_path / "apart", apart)
    line = "\n".join(headline_section(load_mod.load(tmp_path / "apart").runs)).split("- disttrain vs megatron: ")[1]
    assert "at one speed of the machine: not adjusted, the probe itself took 1.33×" in line
    # a steady machine: the probe's spread is its own noise, the rates' their own; no slope to trust
    steady = _probed_repeats("megatron", 6.0, [1.0] * 5, 0, "m", rng) + _probed_repeats("disttrain", 6.6, [1.0] * 5,
                                                                                         10, "t", rng)
    for r in steady:
        jitter = 1 + 0.1 * rng.standard_normal()
        r["metrics"]["probe_cpu_s"] = {"gemm": 0.003, "dispatch": 0.002, "memory": 0.003 * jitter}
    write_results(tmp_path / "steady", steady)
    line = "\n".join(headline_section(load_mod.load(tmp_path / "steady").runs)).split("- disttrain vs megatron: ")[1]
    assert "at one speed of the machine: not adjusted, the probe's slope is not told from zero" in line
    del recs[0]["metrics"]["probe_cpu_s"]          # one repeat without: the two sides are no longer alike
    write_results(tmp_path / "partial", recs)
    partial = "\n".join(headline_section(load_mod.load(tmp_path / "partial").runs))
    assert "  - at one speed of the machine (" not in partial
    for r in recs[1:]:
        del r["metrics"]["probe_cpu_s"]
    write_results(tmp_path / "none", recs)
    assert "  - at one speed of the machine (" not in "\n".join(headline_section(load_mod.load(tmp_path / "none").runs))
    assert math.isnan(bench_speed.probe_seconds([{"metrics": {"probe_cpu_s": {"gemm": -1.0}}}])[0])


def test_an_ablation_gives_its_ratio_at_one_speed_of_the_machine_too(tmp_path):
    from analysis.report import ablation_section
    rng = np.random.default_rng(12)
    recs = (_probed_repeats("disttrain", 6.0, [0.8, 1.2, 0.9, 1.1, 1.0], 0, "none", rng, exp="reorder",
                            data={"reorder": "none"})
            + _probed_repeats("disttrain", 6.6, [1.2, 0.8, 1.1, 0.9, 1.25], 10, "both", rng, exp="reorder",
                              data={"reorder": "both"}))
    write_results(tmp_path / "r", recs)
    line = next(x for x in ablation_section(load_mod.load(tmp_path / "r").runs) if x.startswith("- reorder"))
    raw, at_speed = line.split("both vs none: ")[1].split(" (at one speed of the machine: ")
    assert "no difference beyond the noise" in raw and ", faster" in at_speed
    assert float(at_speed.split("×")[0]) == pytest.approx(1.1, abs=0.02)


def test_repeats_give_medians_intervals_and_verdicts(tmp_path):
    rng = np.random.default_rng(3)
    recs = (_repeats("megatron", 1.00 * (1 + 0.02 * rng.standard_normal(5)), 0, "m")
            + _repeats("deepspeed", 1.02 * (1 + 0.10 * rng.standard_normal(5)), 10, "d")
            + _repeats("disttrain", 1.50 * (1 + 0.02 * rng.standard_normal(5)), 20, "t")
            + _repeats("disttrain", 1.20 * (1 + 0.02 * rng.standard_normal(5)), 30, "t2"))   # its second layout
    for r in recs:
        r["metrics"].update(busy_machine=False, outside_cpu_share=0.01)
    recs[3]["metrics"].update(busy_machine=True, outside_cpu_share=0.4)
    write_results(tmp_path / "r", recs)
    data = load_mod.load(tmp_path / "r", baseline="megatron")
    best = best_layouts(data.runs, baseline="megatron").set_index("system")
    assert list(best["n_repeats"]) == [5, 5, 5]
    assert best.loc["disttrain", "samples_per_s"] == pytest.approx(       # the median, not the best repeat
        np.median([r["metrics"]["samples_per_s"] for r in recs if r["config_key"] == "t"]))
    assert best.loc["disttrain", "speedup_low"] > 1.0
    from analysis.report import headline_section
    text = "\n".join(headline_section(data.runs))
    assert "- disttrain vs megatron: " in text and text.split("- disttrain vs megatron: ")[1].split("\n")[0].endswith(
        "], faster; disttrain's best of 2 configurations.")
    assert "- disttrain vs deepspeed: " in text
    assert "| megatron | tp1-pp1-dp4 | 5 |" in text
    assert text.count("] (94%) |") == 3       # 5 repeats: the range, which covers the median 93.75% of the time
    assert "1 of 20 measured runs were measured on a busy machine" in text
    report = write_report(tmp_path / "r", tmp_path / "out", baseline="megatron").read_text()
    assert "| 5 |" in report and "speedup vs megatron" in report


def test_one_configuration_measured_on_two_machines_is_two_configurations(tmp_path):
    """config_key is the resolved config, which leaves the machine out: the same sweep run on an
    EPYC VM and a Xeon box (or an H100 and an H200) are never pooled as repeats or compared."""
    recs = _repeats("megatron", [1.0, 1.1, 1.2], 0, "m") + _repeats("megatron", [2.0, 2.1, 2.2], 10, "m")
    for r, cpu, cores in zip(recs, ["AMD EPYC"] * 3 + ["Intel Xeon"] * 3, [2] * 3 + [16] * 3):
        r["env"] = {"hardware": {"cpu": cpu, "cpu_count": cores, "gpu": None}}
    write_results(tmp_path / "r", recs)
    configs = configurations(load_mod.load(tmp_path / "r").runs).sort_values("cluster")
    assert list(configs["cluster"]) == ["cpu (AMD EPYC, 2 cores)", "cpu (Intel Xeon, 16 cores)"]
    medians = list(configs["samples_per_s"])
    assert list(configs["n_repeats"]) == [3, 3] and medians[1] / medians[0] == pytest.approx(2.1 / 1.1)
    gpu = {"config": {"device": "cuda"}, "env": {"hardware": {"gpu": {"name": "NVIDIA H200", "count": 1}}}}
    assert load_mod.where_it_ran(gpu) == "cuda (NVIDIA H200)"
    assert load_mod.where_it_ran({"config": {"cluster": "h200-ib", "device": "cuda"}}) == "h200-ib"
    assert load_mod.where_it_ran({"config": {"device": "cpu"}, "env": {}}) == "cpu"      # older records


TOY = "toy-dp"  # a system defined only in this test, never registered


def toy_records() -> list[dict]:
    """The three registered systems plus an unregistered one, in the main comparison and scaling."""
    recs, i = [], iter(range(1000))
    for system, speed in (*SYSTEM_SPEED.items(), (TOY, 1.2)):
        layout = "toy-layout" if system == TOY else None
        recs.append(_record(next(i), system, "small", 4, speed=speed, layout=layout))
        for n in (1, 2):
            recs.append(_record(next(i), system, "tiny", n, speed=speed, layout=layout, exp="scaling"))
    return recs


@pytest.mark.slow
def test_unregistered_system_is_ordered_colored_and_reported(tmp_path):
    assert TOY not in system_names()
    d = tmp_path / "results"
    write_results(d, toy_records())
    data = load_mod.load(d)
    # Baselines first, then the systems under study (registered or not), each by name.
    assert load_mod.system_order(data.runs["system"]) == [*baseline_names(), "disttrain", TOY]
    palette = system_palette(data.runs["system"])
    assert list(palette) == load_mod.system_order(data.runs["system"])
    assert len(set(palette.values())) == len(palette)
    # A registered system keeps its color whatever else a figure shows.
    assert system_palette(["disttrain"])["disttrain"] == palette["disttrain"]
    text = write_report(d, tmp_path / "out").read_text()
    assert "*Skipped:" not in text.split("## Figures")[1].split("### Ablation")[0]
    assert f"| {TOY} | small |" in text
    best = data.runs[data.runs["experiment"] == "main"].groupby("system")["samples_per_s"].max()
    for b in baseline_names():      # one run each: the ratio, and no verdict without repeats
        assert f"- {TOY} vs {b}: {best[TOY] / best[b]:.2f}× (one run each" in text
    assert "- disttrain vs megatron:" in text and "- megatron vs" not in text


@pytest.mark.slow
def test_no_baseline_skips_speedups_with_a_note(tmp_path, capsys):
    d = tmp_path / "results"
    write_results(d, [r for r in toy_records() if r["system"] not in baseline_names()])
    data = load_mod.load(d)
    assert data.baseline is None
    with pytest.raises(NoData, match="--baseline"):
        FIGURES["speedup"](data)
    text = write_report(d, tmp_path / "out").read_text()
    assert "No speedup is given" in text and "speedup vs" not in text
    assert " vs " not in text.split("## Headline")[1].split("## Summary")[0]  # no baseline to compare against
    assert main(["report", "--results", str(d), "--out", str(tmp_path / "o"), "--baseline", TOY]) == 0
    assert f"speedup vs {TOY}" in (tmp_path / "o" / "report.md").read_text()


@pytest.mark.slow
def test_map_share_and_paper_table_from_simulated_records(tmp_path):
    from analysis.fig_map import speedup_map
    from analysis.paper import paper_rows
    from bench.sim.batch import draw_batch
    from bench.sim.simulate import simulate_record
    from workloads.flops import batch_flops
    from workloads.presets import get_workload
    recs = {s: simulate_record("mllm-9b", s, 16, num_batches=1) for s in ("megatron", "disttrain")}
    write_results(tmp_path / "r", list(recs.values()))
    runs = load_mod.load(tmp_path / "r").runs
    (row,) = speedup_map(runs, "megatron").to_dict("records")
    w = get_workload("mllm-9b")
    flops = batch_flops(w, draw_batch(w, recs["disttrain"]["config"]["global_batch_size"], 0, 0))
    assert row["side_share"] == pytest.approx((flops.encoder + flops.generator) / flops.total, rel=1e-9)
    ratio = recs["disttrain"]["metrics"]["samples_per_s"] / recs["megatron"]["metrics"]["samples_per_s"]
    assert row["speedup"] == pytest.approx(ratio)
    claims = {r["claim"]: r for r in paper_rows(runs, "megatron")}
    assert claims["up to 2.2x Megatron-LM throughput"]["ours (simulated)"].startswith(f"up to {ratio:.2f}x megatron")
    assert "54.7% MFU, 72B MLLM on 1172 GPUs" not in claims        # no 72B / 1172-GPU record here


@pytest.mark.parametrize("simulated_disttrain_s, words", [(1.6, "predicts 1.25×, inside the measured interval."),
                                                           (1.0, "predicts 2.00×, outside the measured interval.")])
def test_headline_gives_the_simulators_prediction_and_the_encoder_heavy_comparison(tmp_path, simulated_disttrain_s,
                                                                                    words):
    recs = (_repeats("megatron", [1.0, 1.05, 0.95, 1.02], 0, "m")      # 4 + 4: the fewest with an interval
            + _repeats("disttrain", [1.2, 1.25, 1.15, 1.22], 10, "t"))
    for r in recs:
        r["tags"]["experiment"] = "encoder-heavy"
    # bench validate's records: one simulated iteration time per measured repeat
    for k, r in enumerate(list(recs)):
        sim = build_record(run_id=f"v{k}", system=r["system"], workload="small", data_profile="heterogeneous",
                           status="ok", layout=r["layout"], num_devices=4, mode="simulated", env={}, config={},
                           tags={"experiment": "validation", "measured_run_id": r["run_id"]},
                           assumptions={"cost_model": "profile"},
                           metrics=_metrics(1.0, 4, iteration_time_s=(2.0 if r["system"] == "megatron"
                                                                      else simulated_disttrain_s)))
        recs.append(sim)
    write_results(tmp_path / "r", recs)
    from analysis.report import headline_section
    text = "\n".join(headline_section(load_mod.load(tmp_path / "r").runs))
    assert "### The encoder-heavy regime" in text and "### The main comparison" not in text
    line = text.split("- disttrain vs megatron: ")[1].split("\n")[0]
    assert line.startswith("1.20× [") and line.endswith("the simulator (bench validate) " + words)


def test_faults_section_counts_the_faults_survived(tmp_path):
    named = _record(0, "megatron", "tiny", 2, status="failed", exp="faults")
    named["reason"] = "rank 1 killed by SIGKILL at step 2; last lines: ..."
    vague = _record(1, "disttrain", "tiny", 2, status="failed", exp="faults")
    vague["reason"] = "exit code 1: Connection closed by peer"
    named["config"]["fault"], vague["config"]["fault"] = "kill@1:2", "kill@1:2"
    write_results(tmp_path / "r", [named, vague, _record(2, "megatron", "tiny", 2)])
    from analysis.faults import faults_section
    text = "\n".join(faults_section(load_mod.load(tmp_path / "r").runs))
    assert "Faults survived: 1/2" in text and "**not survived**: `disttrain`" in text


def test_heterogeneous_section_gives_gains_over_homogeneous_beside_the_papers(data):
    from analysis.fig_hetero import configurations_frame
    from analysis.heterogeneous import heterogeneous_section
    df = configurations_frame(data.runs)
    assert len(df) == 6 and set(df["configuration"]) == {"homogeneous", "colocated", "non-colocated"}
    colocated = df[df["configuration"] == "colocated"]
    assert colocated["gain_tflops_per_gpu"].round(6).tolist() == [0.3, 0.3]
    text = "\n".join(heterogeneous_section(data.runs))
    assert "colocated, tflops per gpu: paper up to +49.3%; model up to +30.0% (long-64k, 64 GPUs of h100-ib)" in text
    assert "non-colocated, tokens per s: paper up to +13.0%; model up to +10.0%" in text


def test_records_of_two_clusters_are_never_compared(tmp_path):
    """The same workload and GPU count simulated on two clusters: each cluster's systems are
    compared among themselves (best layout, speedup, scaling panel), never across."""
    recs = []
    for k, (cluster, system, speed) in enumerate([("h100-ib", "megatron", 1.0), ("h100-ib", "disttrain", 1.5),
                                                  ("h200-ib", "megatron", 3.0), ("h200-ib", "disttrain", 2.0)]):
        for j, n in enumerate((64, 128)):
            r = _record(10 * k + j, system, "mllm-72b", n, mode="simulated", exp="scaling", speed=speed)
            r["config"]["cluster"] = cluster
            recs.append(r)
    write_results(tmp_path / "r", recs)
    runs = load_mod.load(tmp_path / "r").runs
    from analysis.fig_perf import scaling_panels
    from analysis.repeats import best_layouts
    best = best_layouts(runs, baseline="megatron")
    assert len(best) == 8
    speedup = {(r["cluster"], r["system"]): round(r["speedup"], 6)
               for _, r in best[best["num_devices"] == 64].iterrows()}
    assert speedup == {("h100-ib", "megatron"): 1.0, ("h100-ib", "disttrain"): 1.5,
                       ("h200-ib", "megatron"): 1.0, ("h200-ib", "disttrain"): round(2 / 3, 6)}
    panels = scaling_panels(best)
    assert sorted(panels) == [("mllm-72b", "heterogeneous", "h100-ib"), ("mllm-72b", "heterogeneous", "h200-ib")]
    assert all(len(df) == 4 and df["cluster"].nunique() == 1 for df in panels.values())
    # measured runs of one workload on two device kinds: a panel each, beside no simulated cluster
    measured = best.assign(mode="measured", cluster=["cpu"] * 4 + ["cuda"] * 4)
    panels = scaling_panels(pd.concat([measured, best]))
    assert sorted(k[2] for k in panels) == ["h100-ib", "h200-ib", "measured on cpu", "measured on cuda"]
    assert all(df["cluster"].nunique() == 1 for df in panels.values())


def test_paper_table_gives_the_72b_mfu_of_each_cluster_with_its_compute_source(tmp_path):
    recs = []
    for k, (cluster, source, speed) in enumerate([("h100-ib", "assumed: datasheet peak x ...", 1.0),
                                                  ("h200-ib", "measured: bench/sim/gpu_profiles/h200.json", 1.1)]):
        r = _record(k, "disttrain", "mllm-72b", 1172, mode="simulated", exp="scaling", speed=speed,
                    extra={"bubble_fraction": 0.1})
        r["config"]["cluster"], r["assumptions"]["compute_source"] = cluster, source
        recs.append(r)
    write_results(tmp_path / "r", recs)
    from analysis.paper import paper_rows
    rows = [r for r in paper_rows(load_mod.load(tmp_path / "r").runs, None) if r["claim"].startswith("54.7%")]
    assert [r["closest workload"].split(" GPUs of ")[1].split(" ")[0] for r in rows] == ["h100-ib", "h200-ib"]
    assert [r["ours (simulated)"].split("compute ")[1] for r in rows] == ["assumed)", "measured)"]
    mfu = [0.02 * 6.0 * s * 1172 / 64 / 1172 for s in (1.0, 1.1)]
    assert [r["ours (simulated)"].split("%")[0] for r in rows] == [f"{100 * m:.1f}" for m in mfu]
