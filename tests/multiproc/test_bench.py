"""Benchmark harness (issue 9): the per-rank worker, the comparison driver's --quick path
and a tiny convergence job each produce valid, complete output files."""
import json
import os
import sys

import pytest

from hipress.launch import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))

RECORD_KEYS = {"system", "model", "np", "config", "steps", "step_s", "throughput", "compute_s", "exposed_comm_s",
               "compression_s", "final_loss", "cpu_s", "cpu_compute_s"}


def _valid_record(r, system):
    assert RECORD_KEYS <= set(r), sorted(RECORD_KEYS - set(r))
    assert r["system"] == system and r["np"] == 2
    assert r["step_s"] > 0 and r["throughput"] > 0 and r["compute_s"] > 0
    assert r["throughput"] == pytest.approx(2 * r["batch_per_rank"] / r["step_s"], rel=1e-6)
    assert r["exposed_comm_s"] >= 0 and r["loss_finite"]
    assert r["cpu_s"] > 0 and r["cpu_compute_s"] > 0


def _run_worker(tmp_path, systems, timeout=240, extra=()):
    """The benchmark worker on 2 ranks, VGG19-like, a few steps: its records, one per system, in order."""
    cmd = [sys.executable, "-m", "hipress.bench.train", "--model", "vgg19", "--systems", ",".join(systems),
           "--warmup", "1", "--steps", "2", "--compute-steps", "1", "--out", str(tmp_path), *extra]
    code, logs = run(cmd, 2, timeout=timeout, quiet=True, env=ENV)
    assert code == 0, "\n".join(logs)[-3000:]
    recs = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["system"] for r in recs] == list(systems)
    for r in recs:
        _valid_record(r, r["system"])
    return recs


def test_worker_emits_records_for_ddp_and_hipress(tmp_path):
    # One DDP and one hipress system in the same processes, no cluster.
    recs = _run_worker(tmp_path, ["ddp", "hipress-ring-onebit"])
    assert recs[0]["compression_s"] is None                # DDP: no engine
    assert recs[1]["compression_s"] > 0 and recs[1]["engine_tasks_per_step"] > 0
    assert recs[1]["hipress"]["compressor"] == "onebit"
    assert (tmp_path / "progress").read_text().strip()


def test_worker_runs_the_overlap_limit(tmp_path):
    """The ceiling system: one allreduce of its share of the gradient bytes per warm-up and timed
    step, none in the compute-only steps."""
    recs = _run_worker(tmp_path, ["overlap-limit-0.5"])
    numel = recs[0]["profile"]["parameters"]
    assert recs[0]["overlap_limit"] == {"fraction": 0.5, "bytes": numel // 2 * 4, "allreduces": 1 + 2}


def test_worker_runs_dear_systems(tmp_path):
    recs = _run_worker(tmp_path, ["hipress-dear", "hipress-dear-terngrad"])
    for r, comp in zip(recs, ("none", "terngrad")):
        assert r["hipress"] == {"strategy": "dear", "compressor": comp, "hierarchical": False}


def test_worker_runs_bucket_tune_systems(tmp_path):
    """A -tune system warms up until its tuner settles and records the trials and the size chosen;
    a -b<MiB> system runs at that fixed size."""
    recs = _run_worker(tmp_path, ["hipress-dear-tune", "hipress-ring-none-b2"],
                       extra=["--tune-trials", "3", "--tune-window", "1", "--tune-warmup", "0"])
    bt = recs[0]["bucket_tune"]
    assert bt["done"] and len(bt["trials"]) == 3 and bt["warmup_steps"] >= 4
    assert bt["range"] == [1 << 20, 4 * recs[0]["profile"]["parameters"]]  # capped at the model's gradient bytes
    assert bt["chosen_bytes"] == min(bt["trials"], key=lambda t: t[1])[0]
    assert bt["trials"][0][0] == 25 << 20 and all(v > 0 for _, v in bt["trials"])
    assert recs[1]["config"]["bucket_bytes"] == 2 << 20 and recs[1]["buckets"] > 1


def test_summary_and_goal_of_bucket_tuning():
    from hipress.bench.compare import goals, summarize

    tune = {"chosen_bytes": 3 << 20, "trials": [[25 << 20, 1.0]] * 12, "warmup_steps": 40, "tuning_s": 50.0,
            "done": True, "buckets": 4}
    recs = [{"system": "hipress-dear-tune", "bandwidth": "10gbit", "step_s": 1.0, "throughput": 96.0,
             "bucket_tune": tune},
            {"system": "hipress-dear-b1", "bandwidth": "10gbit", "step_s": 1.0, "throughput": 90.0},
            {"system": "hipress-dear-b4", "bandwidth": "10gbit", "step_s": 1.0, "throughput": 100.0}]
    systems = ["hipress-dear-tune", "hipress-dear-b1", "hipress-dear-b4"]
    rows = summarize(recs, ["10gbit"], systems)
    assert rows[0]["note"] == "tuned to 3.00 MiB (4 buckets) after 12 trials, 40 steps, 50 s"
    g, = goals("resnet50", rows, ["10gbit"])
    assert g["best"] == "hipress-dear-b4" and g["ratio"] == pytest.approx(0.96) and g["met"]
    recs[0]["throughput"] = 94.0
    g, = goals("resnet50", summarize(recs, ["10gbit"], systems), ["10gbit"])
    assert not g["met"]


def test_goals_of_dear_against_ddp_and_its_bound():
    from hipress.bench.compare import goals, summarize

    ddp = {"system": "ddp", "bandwidth": "1gbit", "np": 4, "step_s": 0.5, "compute_s": 0.25, "ff_s": 0.1,
           "exposed_comm_s": 0.25, "throughput": 100.0}
    # dear: forward 0.1 s, backward 0.15 s, 0.2 s on the comm queue (0.1 per phase): eq. 6's bound is
    # 4 x 0.25 / (0.25 + 0.2 - 0.1 - 0.1) = 4.0, DDP's speed-up 4 x 0.25 / 0.5 = 2.0: at most 2.0x DDP
    dear = {"system": "hipress-dear", "bandwidth": "1gbit", "np": 4, "step_s": 0.4, "compute_s": 0.25, "ff_s": 0.1,
            "comm_busy_s": 0.2, "exposed_comm_s": 0.15, "throughput": 125.0}
    rows = summarize([ddp, dear], ["1gbit"], ["ddp", "hipress-dear"])
    vs_ddp, of_bound = goals("bert", rows, ["1gbit"])
    assert vs_ddp["ratio"] == pytest.approx(1.25) and vs_ddp["met"] and vs_ddp["eq6_x_ddp"] == pytest.approx(2.0)
    assert "1.10x ddp (eq. 6 allows 2.00x)" in vs_ddp["goal"]
    assert of_bound["ratio"] == pytest.approx(2.5 / 4.0) and not of_bound["met"]
    # where DDP hides its communication the target is not to lose (0.97x)
    ddp.update(exposed_comm_s=0.01, step_s=0.26)
    dear["throughput"] = 96.0
    vs_ddp, _ = goals("bert", summarize([ddp, dear], ["1gbit"], ["ddp", "hipress-dear"]), ["1gbit"])
    assert "0.97x ddp" in vs_ddp["goal"] and not vs_ddp["met"]


def test_worker_runs_covap_systems(tmp_path):
    # COVAP's warm-up runs on until its filter is on (settling DDP's buckets, profiling)
    recs = _run_worker(tmp_path, ["hipress-covap", "ddp-covap-hook"], timeout=300)
    from hipress.torch.covap import MAX_INTERVAL, PROFILE_STEPS, interval_from_ccr

    for r in recs:
        cv = r["covap"]
        assert cv["filter_on"] and cv["warmup_steps"] > PROFILE_STEPS, cv
        p = cv["profile"]
        assert p["t_comp"] > 0 and p["interval"] == min(interval_from_ccr(p["ccr"]), MAX_INTERVAL["local"])


def test_summary_reports_compute_fraction_and_covap_interval():
    from hipress.bench.compare import summarize, table

    recs = [{"system": "ddp", "bandwidth": "1gbit", "step_s": 2.0, "compute_s": 0.5, "throughput": 10.0},
            {"system": "hipress-covap", "bandwidth": "1gbit", "step_s": 0.8, "compute_s": 0.6, "throughput": 25.0,
             "covap": {"profile": {"interval": 4, "ccr": 3.21}}}]
    rows = {r["system"]: r for r in summarize(recs, ["1gbit"], ["ddp", "hipress-covap"])}
    assert rows["ddp"]["x_compute"] == pytest.approx(0.25)
    assert rows["hipress-covap"]["x_compute"] == pytest.approx(0.5 / 0.8)  # the model's (DDP's) compute time
    alone, = summarize(recs[1:], ["1gbit"], ["hipress-covap"])
    assert alone["x_compute"] == pytest.approx(0.75)  # no ddp row: its own compute-only steps
    assert rows["hipress-covap"]["x_ddp"] == pytest.approx(2.5)
    assert rows["hipress-covap"]["note"] == "interval 4 at CCR 3.21"
    assert "interval 4 at CCR 3.21" in table(list(rows.values()))
    assert "spread" not in rows["ddp"]  # one run: no spread


def test_summary_reports_the_spread_of_repeats():
    from hipress.bench.compare import summarize, table

    recs = [{"system": "ddp", "bandwidth": "1gbit", "step_s": 1.0, "throughput": tp} for tp in (100.0, 90.0, 110.0)]
    row, = summarize(recs, ["1gbit"], ["ddp"])
    assert row["throughput"] == 100.0 and row["spread"] == pytest.approx(0.2)
    assert "| 3 | 20% |" in table([row])


def test_parse_system_names():
    from hipress.bench.train import parse_system

    assert parse_system("hipress-ps-dgc") == {"kind": "hipress", "strategy": "ps", "compression": "dgc", "plan": None}
    assert parse_system("hipress-ring-tbq-plan")["plan"] == "auto"
    assert parse_system("hipress-powersgd")["compression"] == "powersgd"
    assert parse_system("ddp-powersgd") == {"kind": "ddp", "hook": "powersgd"}
    assert parse_system("hipress-dear") == {"kind": "hipress", "strategy": "dear", "compression": "none",
                                            "plan": None}
    assert parse_system("hipress-dear-tbq")["compression"] == "tbq"
    assert parse_system("hipress-covap")["compression"] == "covap"
    assert parse_system("hipress-covap-bf16") == {"kind": "hipress", "strategy": "auto", "compression": "covap",
                                                  "plan": None, "covap": {"wire": "bf16"}}
    assert parse_system("hipress-covap-i8")["covap"] == {"interval": 8}
    assert parse_system("hipress-covap-bf16-i16")["covap"] == {"wire": "bf16", "interval": 16}
    assert parse_system("ddp-covap-hook") == {"kind": "ddp", "hook": "covap"}
    assert parse_system("hipress-bf16") == {"kind": "hipress", "strategy": "ring", "compression": "auto",
                                            "plan": {"max_compress_bytes": 0, "bf16": True}}
    for name in ("hipress-dear-powersgd", "hipress-dear-tbq-plan"):  # not carried by the ring's phases
        with pytest.raises(ValueError):
            parse_system(name)
    with pytest.raises(ValueError):
        parse_system("hipress-ring-zip")
    assert parse_system("hipress-dear-tune") == {"kind": "hipress", "strategy": "dear", "compression": "none",
                                                 "plan": None, "bucket_bytes": "tune"}
    assert parse_system("hipress-ring-onebit-b0.5")["bucket_bytes"] == 1 << 19
    assert parse_system("hipress-dear-tbq-b4")["bucket_bytes"] == 4 << 20
    assert parse_system("hipress-auto-coord") == {"kind": "hipress", "strategy": "auto", "compression": "auto",
                                                  "plan": None, "coordinator": True}
    assert parse_system("hipress-auto-nocoord")["coordinator"] is False
    assert parse_system("hipress-ring-auto")["strategy"] == "ring"
    assert parse_system("hipress-ps-onebit-b4-coord")["bucket_bytes"] == 4 << 20
    assert parse_system("hipress-ps-terngrad-p0-coord") == {"kind": "hipress", "strategy": "ps",
                                                            "compression": "terngrad", "plan": None,
                                                            "partition_bytes": None, "coordinator": True}
    assert parse_system("hipress-ps-dgc-b4-p2")["partition_bytes"] == 2 << 20
    assert parse_system("overlap-limit") == {"kind": "overlap-limit", "fraction": 1.0}
    assert parse_system("overlap-limit-0.25") == {"kind": "overlap-limit", "fraction": 0.25}
    for name in ("hipress-ring-tbq-plan-tune", "hipress-covap-tune", "hipress-covap-bf16-b4", "hipress-dear-b0",
                 "ddp-tune", "hipress-ps-tbq-plan-p0", "hipress-covap-p0", "ddp-p0",
                 "overlap-limit-0", "overlap-limit-x", "overlap-limit-tune", "ddp-coord", "hipress-coord-tune",
                 "ddp-nocoord", "hipress-covap-i0", "hipress-covap-i8-bf16", "hipress-covap-i8-b4"):
        with pytest.raises(ValueError):
            parse_system(name)


@pytest.mark.slow  # an emulated cluster and two launches of ranks: 24 s here under load
def test_plain_sync_compares_the_two_uncompressed_paths(tmp_path):
    """2 ranks, 2 small buckets, 2 rounds of each path: both timed, their results agreed
    (the worker checks them against each other), the JSON holds every round."""
    from hipress.bench import plain_sync

    out = tmp_path / "plain.json"
    res = plain_sync.main(["--np", "2", "--bandwidth", "1gbit", "--buckets", "2", "--bucket-mb", "0.25",
                           "--rounds", "2", "--timeout", "240", "--json", str(out)])
    assert res["transport"] == "torch/gloo" and res["np"] == 2
    for kind in ("allreduce", "ring"):
        assert len(res["times"][kind]) == 2 and all(t > 0 for t in res["times"][kind])
    assert json.loads(out.read_text())["median_s"] == res["median_s"]


def test_overhead_times_every_system_and_the_hook(tmp_path):
    """2 local ranks, one block of one step per system: every system timed (wall, process and
    training-thread CPU, forward / backward / opt.step), the other threads' CPU split by what they
    run (within the process's; hipress's engine threads busy in its systems), the first is the base,
    DDP's model without communication is the compute-only row, and the hipress systems' hook timed
    once per gradient of the model (dear's too: each block ends with its deferred updates done).
    COVAP is timed once its profile is made (its filter on), not while it profiles."""
    from hipress.bench import models, overhead

    out = tmp_path / "overhead.json"
    res = overhead.main(["--model", "resnet50", "--np", "2", "--blocks", "1", "--steps", "1",
                         "--systems", "ddp,hipress-ring-none,hipress-dear,hipress-covap", "--timeout", "240",
                         "--json", str(out)])
    rows = {r["system"]: r for r in res["rows"]}
    assert list(rows) == ["ddp", "compute-only", "hipress-ring-none", "hipress-dear", "hipress-covap"]
    assert rows["ddp"]["x_base"] == 1.0
    assert res["raw"]["covap"]["hipress-covap"]["interval"] >= 1  # a profile exists once its warm-up ends
    for r in rows.values():
        assert r["step_s"] > 0 and 0 < r["main_cpu_s"] <= r["cpu_s"]
        assert all(r[k] > 0 for k in overhead.PHASES) and sum(r[k] for k in overhead.PHASES) <= 1.01 * r["step_s"]
        # a thread's /proc figure may lag its clock by a scheduler tick at either end of a block
        assert all(r[k] >= 0 for k in overhead.THREADS)
        assert r["main_cpu_s"] + sum(r[k] for k in overhead.THREADS) <= 1.05 * r["cpu_s"] + 0.01
    assert "hook_us_per_gradient" not in rows["compute-only"]
    for hp in (rows["hipress-ring-none"], rows["hipress-dear"], rows["hipress-covap"]):
        assert hp["engine_compute_cpu_s"] + hp["engine_comm_cpu_s"] > 0
        assert hp["gradients_per_step"] == len(list(models.get("resnet50").build().parameters()))
        assert hp["hook_us_per_gradient"] > 0
    assert "hook_us_per_gradient" not in rows["ddp"]
    assert json.loads(out.read_text())["rows"] == res["rows"]
    with pytest.raises(SystemExit, match="not horovod"):
        overhead.main(["--np", "2", "--systems", "ddp,horovod"])


def test_links_times_three_patterns_of_checked_messages(tmp_path):
    """3 local ranks: incast, all-to-all at once and in matchings each timed; every rank checks each
    message it received against its sender's bytes (a wrong peer or a lost message fails the ranks).
    Two ranks share no link, and local processes no switch (--switch-buffer): refused."""
    from hipress.bench import links

    out = tmp_path / "links.json"
    res = links.main(["--np", "3", "--mib", "0.25", "--repeats", "2", "--timeout", "240", "--json", str(out)])
    assert [r["pattern"] for r in res["rows"]] == list(links.PATTERNS)
    assert all(r["ms"] > 0 and "line_rate_ms" not in r for r in res["rows"])  # loopback: no line rate
    assert json.loads(out.read_text())["rows"] == res["rows"]
    with pytest.raises(SystemExit, match="at least 3"):
        links.main(["--np", "2"])
    with pytest.raises(SystemExit, match="needs a --bandwidth"):  # local processes have no switch
        links.main(["--np", "3", "--switch-buffer", "256k"])


def test_compare_quick_writes_json_markdown_png(tmp_path):
    pytest.importorskip("matplotlib")
    from hipress.bench import compare

    docs = compare.main(["--quick", "--np", "2", "--bandwidth", "1gbit", "--switch-buffer", "256k",
                         "--out-dir", str(tmp_path), "--no-progress", "--timeout", "240"])
    doc = json.loads((tmp_path / "compare-vgg19.json").read_text())
    assert docs["vgg19"]["rows"] == doc["rows"]
    systems = {r["system"]: r for r in doc["rows"]}
    assert set(systems) == {"ddp", "hipress-ring-onebit"}
    for r in systems.values():
        assert r["throughput"] > 0 and r["bandwidth"] == "1gbit", r
    assert systems["ddp"]["x_ddp"] == 1.0
    assert doc["config"]["np"] == 2 and doc["cluster"]["emulated"] in (True, False)
    assert doc["config"]["switch_buffer"] == "256k"
    md = (tmp_path / "compare-vgg19.md").read_text()
    assert "| ddp |" in md and "switch buffer 256k" in md
    for name in ("compare-vgg19-throughput.png", "compare-vgg19-breakdown.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="needs a bandwidth"):  # an unshaped link has no switch queue
        compare.main(["--quick", "--bandwidth", "1gbit,none", "--switch-buffer", "256k", "--out-dir", str(tmp_path)])


def test_convergence_tiny_digits_job(tmp_path):
    pytest.importorskip("sklearn")
    from hipress.bench import convergence

    # tbq's bad option fails the launch the two share: onebit still trains (in a launch of its own)
    doc = convergence.main(["--task", "digits", "--algos", "tbq,onebit", "--kwargs", 'tbq={"bogus": 1}',
                            "--epochs", "1", "--out-dir", str(tmp_path),
                            "--timeout", "240"] + ([] if _has_mpl() else ["--no-plots"]))
    assert "bogus" in doc["runs"]["tbq"]["output_tail"], doc["runs"]["tbq"]
    run_ = doc["runs"]["onebit"]
    assert "error" not in run_, run_.get("output_tail")
    pts = run_["points"]
    assert [p["epoch"] for p in pts] == [0, 1]
    assert 0 <= pts[-1]["test_accuracy"] <= 100 and pts[-1]["wall_s"] > 0
    assert [p["epoch"] for p in doc["reference"]["onebit"]["points"]] == [0, 1]  # the simulator's, beside it
    assert "reference" in doc["rows"][1] and "hipress_minus_reference" in doc["rows"][1]
    assert json.loads((tmp_path / "convergence-digits.json").read_text())["rows"][1]["algorithm"] == "onebit"
    assert (tmp_path / "convergence-digits.md").exists()
    if _has_mpl():
        assert (tmp_path / "convergence-digits.png").read_bytes()[:4] == b"\x89PNG"


def _has_mpl():
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False
