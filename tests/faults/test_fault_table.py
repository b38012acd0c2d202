"""The fault table (issue 22) with real ranks: one scenario per row, run by the same functions
as ``python -m hipress.bench.faults`` (hipress/bench/faults.py); these tests assert on what the
ranks reported. Each row starts and stops its own ranks (2-3 local processes over gloo) with a
short HIPRESS_TIMEOUT_S; every wait of the scenario is bounded, so a hang fails the row.

The non-finite row re-runs every algorithm once; the detailed per-strategy check is
tests/multiproc/test_nonfinite_ranks.py, so here it is slow-marked, like the mpirun row,
the second mismatch row and the long memory run.
"""
import shutil
import signal

import pytest

from hipress.bench import faults
from hipress.bench.faults import SLACK_S, VICTIM

pytestmark = pytest.mark.timeout(300)


_rows = {}


def row(name, **kw):
    """The scenario's Row, run once per module (several tests assert on one run)."""
    key = (name, tuple(sorted(kw.items())))
    if key not in _rows:
        _rows[key] = faults.run_scenario(name, **kw)
    r = _rows[key]
    assert not any(f.startswith("the scenario broke") for f in r.failures), r.failures
    return r


def survivors(r, np):
    return {k: v for k, v in r.facts["results"].items() if int(k) != VICTIM and int(k) < np}


# ---- a rank killed mid-training (SIGKILL) -------------------------------------------------

def test_killed_rank_every_survivor_raises_in_time():
    r = row("killed")
    assert r.facts["codes"][VICTIM] == -signal.SIGKILL
    got = survivors(r, 3)
    assert sorted(got) == [0, 2], r.facts
    for rank, res in got.items():
        assert "error" in res, f"rank {rank} finished training although rank {VICTIM} was killed: {res}"
        assert res["error_after_s"] <= r.facts["timeout_s"] + SLACK_S, res


def test_killed_rank_is_named_by_every_survivor():
    r = row("killed")
    for rank, res in survivors(r, 3).items():
        assert faults._names_victim(res["error"]), f"rank {rank}: {res['error']}"


def test_killed_rank_stops_the_launched_job_and_leaves_nothing():
    r = row("killed_under_launcher")
    assert r.facts["injected"], r.facts["log_tail"]
    assert r.facts["code"] not in (0, None), r.facts["log_tail"]
    assert r.facts["left"] == []


@pytest.mark.slow  # mpirun's start-up makes it the costliest row; the launcher row above is the default one
@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_killed_rank_under_mpirun_ends_the_job_and_leaves_nothing():
    r = row("killed_under_mpirun")
    assert r.facts["injected"], r.facts["log_tail"]
    assert r.facts["code"] not in (0, None), r.facts["log_tail"]
    assert r.facts["left"] == []


# ---- a rank stopped (SIGSTOP), then continued ---------------------------------------------

def test_rank_stopped_within_the_timeout_changes_nothing():
    r = row("stopped_briefly")
    assert r.passed, r.failures
    params = {res["params"] for res in r.facts["results"].values()}
    refs = {res["reference"] for res in r.facts["results"].values()}
    assert len(params) == 1 and params == refs


def test_rank_stopped_beyond_the_timeout_fails_the_others_without_hang():
    r = row("stopped_too_long")
    assert "a survivor still waits for the stopped rank (a hang)" not in r.failures
    assert not any("hung" in f for f in r.failures), r.failures
    for rank, res in survivors(r, 2).items():
        assert "error" in res and res["error_after_s"] <= r.facts["timeout_s"] + SLACK_S, res
    # continued after its peers left, it ended (no "hung" failure above) without finishing its training
    assert "params" not in r.facts["results"].get(VICTIM, {}), r.facts["results"]


def test_rank_stopped_beyond_the_timeout_is_named():
    r = row("stopped_too_long")
    for rank, res in survivors(r, 2).items():
        assert faults._names_victim(res["error"]), f"rank {rank}: {res['error']}"


# ---- a rank slowed ------------------------------------------------------------------------

def test_slow_rank_gives_the_same_result():
    r = row("slowed")
    assert r.passed, r.failures
    assert len({res["params"] for res in r.facts["results"].values()}) == 1


# ---- uneven inputs --------------------------------------------------------------------------

def test_uneven_inputs_with_collective_join():
    r = row("uneven_collective")
    assert r.passed, r.failures
    res = r.facts["results"]
    assert res[0]["last_joined"] == res[1]["last_joined"] == 1
    assert res[1]["averages"] == [1.5, 1.5, 1.0, 1.0]  # zeros from rank 0 once it joined


def test_uneven_inputs_with_optimizer_join():
    r = row("uneven_optimizer")
    assert r.passed, r.failures


# ---- non-finite gradients -------------------------------------------------------------------

@pytest.mark.slow
def test_nonfinite_gradient_skipped_on_every_rank_for_every_algorithm():
    r = row("nonfinite")
    assert r.passed, r.failures
    from hipress import compression
    assert sorted(r.facts["results"][0]["algorithms"]) == compression.available()


# ---- mismatched configuration ------------------------------------------------------------------

def test_mismatched_strategy_errors_on_every_rank():
    r = row("mismatched_strategy")
    assert "a rank hung" not in r.failures
    for rank in (0, 1):
        assert "error" in r.facts["results"][rank], r.facts  # never silently trains on


def test_mismatched_strategy_error_names_it_and_the_rank():
    r = row("mismatched_strategy")
    assert r.passed, r.failures


@pytest.mark.slow
def test_mismatched_compression_error_names_it_and_the_rank():
    r = row("mismatched_compression")
    assert r.passed, r.failures


# ---- a rank that never starts ------------------------------------------------------------------

def test_rank_never_starting_ends_rank_0_with_an_error():
    r = row("never_starts")
    assert "rank 0 hung" not in r.failures
    assert "error" in r.facts["results"][0]


def test_rank_never_starting_is_named():
    r = row("never_starts")
    assert r.passed, r.failures


# ---- malformed payloads, a foreign address ------------------------------------------------------

def test_malformed_payloads_raise_value_error_without_allocating():
    r = row("malformed_payloads", cases=2000)
    assert r.passed, r.failures
    res = r.facts["results"]
    assert res["cap_bites"] and res["other_count"] == 0 and res["rejected"] > 0


def test_store_refuses_a_non_advertised_address():
    r = row("foreign_address")
    if r.skipped:
        pytest.skip(r.skipped)
    assert r.passed, r.failures
    assert r.facts["results"][0]["loopback"] is True and r.facts["results"][0]["from_other"] is False


# ---- memory ---------------------------------------------------------------------------------

def test_memory_flat_over_300_steps():
    r = row("memory_flat", steps=300)
    assert r.passed, r.failures
    assert sorted(r.facts["growth_mib"]) == [0, 1]


@pytest.mark.slow
def test_memory_flat_over_3000_steps():
    r = row("memory_flat", steps=3000)
    assert r.passed, r.failures
