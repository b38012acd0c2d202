"""The kernel benchmark's regression check (hipress.bench.kernels: ratios to copy, medians of runs,
floors, --check's exit status) on synthetic figures: no timing is asserted here."""
import json

import pytest

from hipress.bench import kernels as K

MB = 1 << 20


def size_result(mb, memcpy_gbs, encode_gbs, payload=100):
    """One size's results as bench_size returns them, with the given one-thread encode GB/s per label."""
    algos = {label: {"threads=1": {"encode_gbs": float(e), "decode_gbs": 2.0 * e, "decode_add_gbs": 2.0 * e,
                                   "payload_bytes": payload, "enc_dec_gbs": e / 2.0}}
             for label, e in encode_gbs.items()}
    return {"bytes": int(mb * MB), "numel": int(mb * MB) // 4, "memcpy_gbs": float(memcpy_gbs), "algorithms": algos}


def with_ratios(size):
    K.add_ratios(size)
    return size


def test_ratios_are_each_kernel_over_the_same_runs_memcpy():
    size = with_ratios(size_result(16, 20.0, {"onebit": 10.0, "tbq": 4.0}))
    row = size["algorithms"]["onebit"]["threads=1"]
    assert row["encode_ratio_to_copy"] == pytest.approx(0.5)
    assert row["decode_ratio_to_copy"] == pytest.approx(1.0)
    assert size["algorithms"]["tbq"]["threads=1"]["encode_ratio_to_copy"] == pytest.approx(0.2)


def test_check_passes_at_or_above_every_floor_and_fails_below():
    floors = {"onebit": 0.25, "powersgd-r4": 0.25}
    ok = {"sizes": [with_ratios(size_result(16, 20.0, {"onebit": 5.0, "powersgd-r4": 6.0})),
                    with_ratios(size_result(64, 10.0, {"onebit": 2.5, "powersgd-r4": 9.0}))]}
    chk = K.check_floors(ok, floors)
    assert chk["passed"] and chk["failures"] == []
    assert chk["measured"]["onebit"] == {"16": pytest.approx(0.25), "64": pytest.approx(0.25)}

    low = {"sizes": [with_ratios(size_result(16, 20.0, {"onebit": 5.0, "powersgd-r4": 6.0})),
                     with_ratios(size_result(64, 10.0, {"onebit": 2.0, "powersgd-r4": 9.0}))]}
    chk = K.check_floors(low, floors)
    assert not chk["passed"]
    assert len(chk["failures"]) == 1 and "onebit" in chk["failures"][0] and "64 MB" in chk["failures"][0]


def test_check_fails_when_a_floored_kernel_or_every_size_is_missing():
    res = {"sizes": [with_ratios(size_result(16, 20.0, {"onebit": 10.0}))]}
    chk = K.check_floors(res, {"onebit": 0.25, "terngrad-2bit": 0.25})
    assert not chk["passed"] and any("terngrad-2bit" in f for f in chk["failures"])
    assert not K.check_floors({"sizes": []}, {"onebit": 0.25})["passed"]


def test_nan_ratio_is_a_failure():
    res = {"sizes": [with_ratios(size_result(16, 20.0, {"onebit": float("nan")}))]}
    assert not K.check_floors(res, {"onebit": 0.25})["passed"]


def test_median_of_runs_takes_each_runs_own_ratio():
    # run 2's memcpy is slow and its kernel too: its ratio (0.5) is the median, not 11 / 20
    runs = [with_ratios(size_result(16, 20.0, {"onebit": 4.0})),    # ratio 0.2
            with_ratios(size_result(16, 10.0, {"onebit": 5.0})),    # ratio 0.5
            with_ratios(size_result(16, 22.0, {"onebit": 22.0}))]   # ratio 1.0
    med = K.median_of_runs(runs)
    row = med["algorithms"]["onebit"]["threads=1"]
    assert med["runs"] == 3
    assert med["memcpy_gbs"] == pytest.approx(20.0)
    assert row["encode_gbs"] == pytest.approx(5.0)
    assert row["encode_ratio_to_copy"] == pytest.approx(0.5)
    assert row["payload_bytes"] == 100


def fake_bench(encode_gbs):
    calls = []

    def bench_size(nbytes, threads, ref_max, repeat, only=None):
        calls.append((nbytes, only))
        return size_result(nbytes / MB, 20.0, encode_gbs)
    return bench_size, calls


@pytest.mark.parametrize("onebit_gbs, exit_code", [(10.0, None), (1.0, 1)])
def test_cli_check_exit_status_and_json(monkeypatch, tmp_path, onebit_gbs, exit_code):
    bench_size, calls = fake_bench({**{label: 8.0 for label in K.FLOORS}, "onebit": onebit_gbs})  # every floor met but onebit's
    monkeypatch.setattr(K, "bench_size", bench_size)
    out = tmp_path / "k.json"
    argv = ["--sizes", "16,64", "--threads", "1", "--runs", "3", "--check", "--out", str(out)]
    if exit_code is None:
        K.main(argv)
    else:
        with pytest.raises(SystemExit) as e:
            K.main(argv)
        assert e.value.code == exit_code
    assert [c[0] for c in calls] == [16 * MB] * 3 + [64 * MB] * 3  # 2 sizes x 3 runs
    assert all(c[1] is None for c in calls)
    saved = json.loads(out.read_text())
    assert saved["check"]["passed"] is (exit_code is None)
    assert saved["sizes"][1]["algorithms"]["onebit"]["threads=1"]["encode_ratio_to_copy"] == pytest.approx(onebit_gbs / 20)


def test_cli_rejects_bad_runs_and_check_without_one_thread(monkeypatch, tmp_path):
    bench_size, _ = fake_bench({"onebit": 10.0})
    monkeypatch.setattr(K, "bench_size", bench_size)
    with pytest.raises(ValueError, match="--runs"):
        K.main(["--runs", "0", "--out", ""])
    with pytest.raises(ValueError, match="threads"):
        K.main(["--sizes", "1", "--threads", "2", "--check", "--out", str(tmp_path / "k.json")])


def test_cli_only_floored_passes_the_floored_labels_and_rejects_unknown(monkeypatch, tmp_path):
    bench_size, calls = fake_bench({label: 8.0 for label in K.FLOORS})
    monkeypatch.setattr(K, "bench_size", bench_size)
    K.main(["--sizes", "16", "--threads", "1", "--only", "floored", "--check", "--out", str(tmp_path / "k.json")])
    assert calls and all(c[1] == set(K.FLOORS) for c in calls)
    with pytest.raises(ValueError, match="unknown kernel"):
        K.main(["--sizes", "16", "--threads", "1", "--only", "onebit,nosuch", "--out", ""])


def test_cpu_time_needs_one_thread_and_is_recorded_then_restored(monkeypatch, tmp_path):
    seen = []

    def bench_size(nbytes, threads, ref_max, repeat, only=None):
        seen.append(K._clock)
        return size_result(nbytes / MB, 20.0, {"onebit": 10.0, "terngrad-2bit": 8.0, "powersgd-r4": 6.0})
    monkeypatch.setattr(K, "bench_size", bench_size)
    out = tmp_path / "k.json"
    K.main(["--sizes", "16", "--threads", "1", "--cpu-time", "--out", str(out)])
    assert seen == [K.time.thread_time]
    assert json.loads(out.read_text())["clock"] == "thread_cpu"
    assert K._clock is K.time.perf_counter
    with pytest.raises(ValueError, match="--cpu-time"):
        K.main(["--sizes", "16", "--threads", "1,2", "--cpu-time", "--out", ""])
