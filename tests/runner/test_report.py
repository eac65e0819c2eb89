"""`lightfleet report` on fake run and sweep directories shaped as the runner writes them: rows,
statuses, knob columns, speedup, the files it writes, which sweep it picks, its errors."""
from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import yaml

from runner.records.jobs import Job, read_job, read_loss_curve
from runner.records.plots import draw_loss_curves, draw_throughput, draw_throughput_memory, pareto_front
from runner.records.report import main
from runner.records.table import differing_knobs

MEASURES = ["status", "world_size", "step_time_ms", "data_wait", "samples_per_s", "tokens_per_s", "mfu", "speedup",
            "peak_memory_mb", "train_loss", "val_loss", "seed", "git_commit"]
PLOTS = ["throughput.png", "throughput_memory.png", "loss_curves.png"]


def write(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))


def make_job(job_dir: Path, strategy: Optional[Dict[str, Any]] = None, samples_per_s: Optional[float] = None,
             failure: Optional[Dict[str, Any]] = None, seed: int = 0, **results: Any) -> Path:
    """A job directory: config and env always; results.yaml when `samples_per_s` is given,
    failure.yaml when `failure` is; a metrics.csv with a loss curve and validation-only rows."""
    # As config.yaml has it: every strategy named, null unless selected.
    strategies = {**dict.fromkeys(("amp", "gradient_merge", "lamb", "lars", "recompute")), **(strategy or {})}
    write(job_dir / "config.yaml", {
        "model": {"_target_": "runner.models.MLPClassifier", "hidden": 64},
        "trainer": {"devices": 1, "max_steps": 20}, "strategy": strategies, "seed": seed,
        "name": job_dir.name, "paths": {"output_dir": str(job_dir)}, "logger": {"csv": {"save_dir": str(job_dir)}}})
    write(job_dir / "env.yaml", {"git_commit": "0123456789abcdef0123", "python": "3.11.7"})
    if samples_per_s is not None:
        write(job_dir / "results.yaml", {"global_step": 20, "train_loss": 0.5, "val_loss": 0.6, "world_size": 1,
                                         "step_time_median_s": 0.0123, "samples_per_s": samples_per_s,
                                         "mfu": None, "peak_memory_mb": 1000.0, **results})
    if failure is not None:
        write(job_dir / "failure.yaml", failure)
    (job_dir / "csv").mkdir(exist_ok=True)
    (job_dir / "csv" / "metrics.csv").write_text(
        "epoch,step,train_loss,val_loss\n0,9,1.25,\n0,9,,1.5\n0,19,0.75,\n")
    return job_dir


def make_sweep(sweep_dir: Path, refused: Optional[Dict[str, Dict[str, Any]]] = None) -> Path:
    write(sweep_dir / "multirun.yaml", {"hydra": {"mode": "MULTIRUN"}})
    jobs = {job.name: {"overrides": [], "status": "finished" if (job / "results.yaml").exists() else "failed"}
            for job in sweep_dir.iterdir() if (job / "config.yaml").exists()}
    write(sweep_dir / "sweep.yaml", {"jobs": {**jobs, **(refused or {})}})
    return sweep_dir


def rows_of(out: Path) -> List[Dict[str, str]]:
    with (out / "report.csv").open(newline="") as table:
        return list(csv.DictReader(table))


def user_error(capsys, argv: List[str]) -> str:
    """The one line `main(argv)` ends with, after checking that it exits 2 without a traceback."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightfleet: error:"), lines
    return lines[0]


def test_a_refused_job_is_a_row_and_rows_sort_by_throughput_with_speedup_over_the_plain_job(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    make_job(sweep / "0", samples_per_s=400.0, tokens_per_s=51200.0, mfu=0.4123)
    make_job(sweep / "2", strategy={"amp": {"dtype": "float16"}}, samples_per_s=1000.0)
    reason = "lamb+lars is not an allowed combination (lamb+lars: both replace the optimizer)"
    make_sweep(sweep, refused={"1": {"overrides": ["strategy=[lars,lamb]", "seed=3"], "status": "refused",
                                     "reason": reason}})
    assert main([str(sweep)]) == 0
    rows = rows_of(sweep)
    assert [row["job"] for row in rows] == ["2", "0", "1"]
    assert [row["strategies"] for row in rows] == ["amp", "none", "lamb+lars"]
    assert rows[2]["status"] == f"refused: {reason}" and rows[2]["seed"] == "3" and rows[2]["samples_per_s"] == ""
    assert float(rows[0]["speedup"]) == pytest.approx(1000.0 / 400.0) and float(rows[1]["speedup"]) == 1.0
    assert rows[2]["speedup"] == "" and rows[0]["git_commit"] == "01234567"
    assert float(rows[1]["mfu"]) == 0.4123 and float(rows[1]["step_time_ms"]) == pytest.approx(12.3)
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == f"Report of {sweep}: 3 jobs; baseline (speedup 1x): job 0 (none)."
    assert "| 2.50x |" in printed and "| 41.2% |" in printed and "| 51200 |" in printed and reason in printed
    assert printed.splitlines()[-1] == " ".join(str(sweep / name) for name in ["report.csv", "report.md", *PLOTS])


def test_failed_out_of_memory_diverged_and_unfinished_jobs_are_reported_and_the_report_succeeds(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    diverged = "diverged: the loss became non-finite (NaN or Inf) at step 5; no checkpoint was written before it"
    make_job(sweep / "0", samples_per_s=100.0)
    make_job(sweep / "1", failure={"status": "failed", "exit_code": 1, "error": "RuntimeError: boom"})
    make_job(sweep / "2", failure={"status": "out_of_memory", "exit_code": 1, "error": "CUDA out of memory"})
    make_job(sweep / "3")  # killed: neither results.yaml nor failure.yaml
    make_job(sweep / "4", failure={"status": "diverged", "exit_code": 3, "error": diverged})
    make_sweep(sweep)
    assert main([str(sweep)]) == 0
    statuses = {row["job"]: row["status"] for row in rows_of(sweep)}
    assert statuses == {"0": "ok", "1": "failed (exit 1): RuntimeError: boom", "2": "out of memory",
                        "3": "failed: did not finish", "4": diverged}
    printed = capsys.readouterr().out
    assert "| failed (exit 1): RuntimeError: boom |" in printed and "| out of memory |" in printed


def test_only_knobs_that_differ_get_a_column(tmp_path):
    sweep = tmp_path / "sweep"
    for name, k_steps in (("0", 2), ("1", 4)):
        make_job(sweep / name, strategy={"gradient_merge": {"k_steps": k_steps, "avg": True}}, samples_per_s=10.0)
    make_sweep(sweep)
    assert main([str(sweep)]) == 0
    with (sweep / "report.csv").open(newline="") as table:
        header = next(csv.reader(table))
    # paths.output_dir and name differ too, but are never knobs; seed is the same: only its own column
    assert header == ["job", "strategies", "strategy.gradient_merge.k_steps", *MEASURES]
    assert [row["strategy.gradient_merge.k_steps"] for row in rows_of(sweep)] == ["2", "4"]


def test_only_keys_whose_values_differ_are_knob_columns():
    plain = Job("0", "none", {"seed": 0, "model.hidden": 64, "strategy.gradient_merge.k_steps": 2}, "ok")
    amp = Job("1", "amp", {"seed": 0, "model.hidden": 64, "strategy.amp.dtype": "float16"}, "ok")
    refused = Job("2", "lamb+lars", {"model.hidden": 128, "model": "mlp"}, "refused: no")
    # A strategy's knobs in one job only: the strategies column tells the jobs apart.
    assert differing_knobs([plain, amp]) == []
    assert differing_knobs([plain, amp, refused]) == ["model.hidden"]
    merged = Job("3", "gradient_merge", {"seed": 0, "strategy.gradient_merge.k_steps": 4}, "ok")
    assert differing_knobs([plain, merged]) == ["strategy.gradient_merge.k_steps"]


def test_the_plots_and_the_csv_are_written_also_when_no_job_finished(tmp_path):
    sweeps = {"some_finished": tmp_path / "a", "none_finished": tmp_path / "b"}
    make_job(sweeps["some_finished"] / "0", samples_per_s=10.0)
    make_job(sweeps["some_finished"] / "1", strategy={"amp": {}}, samples_per_s=20.0, peak_memory_mb=500.0)
    make_job(sweeps["none_finished"] / "0", failure={"status": "failed", "exit_code": 3, "error": "boom"})
    for sweep in sweeps.values():
        assert main([str(make_sweep(sweep, refused={"9": {"overrides": [], "status": "refused", "reason": "no"}}))]) == 0
        for plot in PLOTS:
            assert (sweep / plot).read_bytes().startswith(b"\x89PNG"), plot
        assert list(rows_of(sweep)[0]) == ["job", "strategies", *MEASURES]  # `amp: {}` adds no knob
    assert [row["speedup"] for row in rows_of(sweeps["none_finished"])] == ["", ""]


def test_a_run_directory_and_several_paths(tmp_path, capsys):
    run = make_job(tmp_path / "runs" / "10-00-00", strategy={"recompute": {"checkpoints": None}}, samples_per_s=5.0)
    sweep = make_sweep(tmp_path / "sweep")
    make_job(sweep / "0", samples_per_s=4.0)
    make_job(sweep / "1" / "a", samples_per_s=3.0)  # hydra.sweep.subdir nests a level
    assert main([str(run)]) == 0 and [row["job"] for row in rows_of(run)] == ["10-00-00"]
    out = tmp_path / "both"
    assert main([str(run), str(sweep), "--out", str(out), "--baseline", "sweep/1/a"]) == 0
    rows = rows_of(out)
    assert [row["job"] for row in rows] == ["10-00-00", "sweep/0", "sweep/1/a"]
    assert float(rows[0]["speedup"]) == pytest.approx(5.0 / 3.0)
    assert "baseline (speedup 1x): job sweep/1/a (none)" in capsys.readouterr().out


def test_no_path_reports_the_newest_sweep_under_multirun(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert user_error(capsys, []) == \
        "lightfleet: error: report: no sweep under multirun/; give a run or sweep directory"
    older, newer = tmp_path / "multirun/2026-01-02/09-00-00", tmp_path / "multirun/2026-01-01/10-00-00-1"
    for age, sweep in enumerate((newer, older)):
        make_job(sweep / "0", samples_per_s=1.0)
        make_sweep(sweep)
        os.utime(sweep, (1_000_000 - age, 1_000_000 - age))
    assert main([]) == 0
    assert (newer / "report.md").is_file() and not (older / "report.md").exists()
    assert capsys.readouterr().out.startswith("Report of multirun/2026-01-01/10-00-00-1:")


def test_bad_paths_and_an_unknown_baseline_are_one_line_and_exit_2(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    make_job(sweep / "0", samples_per_s=1.0)
    make_job(sweep / "12", failure={"status": "failed", "exit_code": 1, "error": "x"})
    make_sweep(sweep)
    assert "is neither a run directory" in user_error(capsys, [str(tmp_path / "nothing")])
    run = make_job(tmp_path / "run", samples_per_s=1.0)
    assert "(did you mean sweep/12" in user_error(capsys, [str(run), str(sweep), "--baseline", "sweep/13"])
    assert "has no samples_per_s" in user_error(capsys, [str(sweep), "--baseline", "12"])
    assert "unrecognized arguments: --bogus" in user_error(capsys, [str(sweep), "--bogus"])


def test_the_pareto_front_keeps_the_jobs_no_other_dominates():
    points = {"small": (100.0, 10.0), "big": (400.0, 30.0), "worse": (400.0, 20.0),
              "wasteful": (500.0, 30.0), "tie": (100.0, 10.0), "best": (200.0, 25.0)}
    assert pareto_front(points) == ["small", "tie", "best", "big"]  # wasteful: as fast as big, more memory
    assert pareto_front({}) == []


def test_the_loss_curve_skips_rows_that_logged_no_train_loss(tmp_path):
    job = make_job(tmp_path / "run", samples_per_s=1.0)
    assert read_loss_curve(job / "csv" / "metrics.csv") == [(9.0, 1.25), (19.0, 0.75)]
    assert read_loss_curve(tmp_path / "missing.csv") == []


def test_the_memory_plot_puts_memory_across_and_throughput_up(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    jobs = [read_job(make_job(tmp_path / name, samples_per_s=rate, peak_memory_mb=memory), name)
            for name, rate, memory in (("small", 50.0, 100.0), ("big", 400.0, 3000.0))]
    figure, axes = pyplot.subplots()
    draw_throughput_memory(axes, jobs)
    assert "memory" in axes.get_xlabel() and "throughput" in axes.get_ylabel()
    assert axes.collections[0].get_offsets().tolist() == [[100.0, 50.0], [3000.0, 400.0]]
    assert axes.get_xlim()[0] == 0 and axes.get_ylim()[0] == 0  # from zero: a few MB of noise look as small as they are
    pyplot.close(figure)


def test_the_memory_plot_keeps_its_points_and_labels_off_the_edges(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    # Close in memory, as runs of one model are: autoscaling put the largest on the edges.
    jobs = [read_job(make_job(tmp_path / name, samples_per_s=rate, peak_memory_mb=memory), name)
            for name, rate, memory in (("plain", 17.4, 885.0), ("amp", 8.8, 871.0), ("recompute", 16.0, 880.0))]
    figure, axes = pyplot.subplots()
    draw_throughput_memory(axes, jobs)
    (left, right), (bottom, top) = axes.get_xlim(), axes.get_ylim()
    for x, y in axes.collections[0].get_offsets().tolist():
        assert left < x < right - 0.1 * (right - left) and bottom < y < top - 0.1 * (top - bottom), (x, y, right, top)
    # A label of a point on the right half reads leftwards from it, inside the axes.
    assert {text.get_text(): text.get_horizontalalignment() for text in axes.texts} == {
        "plain (none)": "right", "amp (none)": "right", "recompute (none)": "right"}
    pyplot.close(figure)


def test_identical_loss_curves_stay_apart_by_style_and_say_so_in_the_legend(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    jobs = [read_job(make_job(tmp_path / name, samples_per_s=1.0), name) for name in ("a", "b", "c")]
    (tmp_path / "c" / "csv" / "metrics.csv").write_text("epoch,step,train_loss\n0,9,1.5\n0,19,1.0\n")
    jobs[2] = read_job(tmp_path / "c", "c")
    figure, axes = pyplot.subplots()
    draw_loss_curves(axes, jobs)
    styles = [(line.get_color(), line.get_linestyle(), line.get_marker()) for line in axes.lines]
    assert len({style[1:] for style in styles}) == 3 and len(set(styles)) == 3  # apart even in one colour
    assert [text.get_text() for text in axes.get_legend().get_texts()] == [
        "a (none)", "b (none), the same curve as a (none)", "c (none)"]
    pyplot.close(figure)


def test_the_bars_read_as_plain_numbers_and_a_one_point_loss_curve_shows(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    jobs = [read_job(make_job(tmp_path / name, samples_per_s=rate), name) for name, rate in (("a", 12700.4), ("b", 230.2))]
    figure, (bars, curves) = pyplot.subplots(2)
    draw_throughput(bars, jobs)
    assert sorted(text.get_text() for text in bars.texts) == ["12700", "230"]  # not 1.27e+04 beside 230
    (tmp_path / "a" / "csv" / "metrics.csv").write_text("epoch,step,train_loss\n0,0,1.5\n")
    draw_loss_curves(curves, [read_job(tmp_path / "a", "a")])
    assert curves.lines[0].get_marker() == "o"
    pyplot.close(figure)


def test_a_job_measured_over_few_steps_is_noted_under_the_table(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    make_job(sweep / "0", samples_per_s=100.0, measured_steps=5, warmup_steps=5)
    make_job(sweep / "1", strategy={"amp": {"dtype": "float16"}}, samples_per_s=150.0, measured_steps=40)
    make_sweep(sweep)
    assert main([str(sweep)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Note:")]
    assert notes == ["Note: job 0 (none) measured 5 steps (after 5 warm-up): its speed and speedup are within the "
                     "noise; measure at least 20 (trainer.max_steps, measure.warmup_steps)."]
    assert notes[0] in (sweep / "report.md").read_text()
