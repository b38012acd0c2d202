"""Compressed training reaches uncompressed accuracy (the accuracy issue), with real ranks.

Default suite, 2 ranks, a short seeded digits run (``python -m hipress.bench.convergence
--task digits --np 2``), test accuracy at least uncompressed accuracy - 3 points: HiPress's
six algorithms x every strategy they accept, and through DDP's comm hook under "auto"; COVAP
(compression="covap") through the optimizer and the hook; every
other registered algorithm (GRACE's family) under strategy "auto", the one a user gets by
default, with its defaults or, for the four whose defaults cannot train at this run's
learning rate, the settings in TUNED (docs/grace.md); those in BY_SEED_MEAN by the mean of
three seeds. Slow (``-m slow``), each judged by the mean of the three seeds: those
others under every strategy, and 4 ranks, strategy "auto", no more than 1 point under
uncompressed for all. Each run
starts and stops its own ranks (hipress.launch, with a timeout).

Where an algorithm is known not to reach the margin yet, the case is marked xfail(strict):
it is reported, never counted as passing, and turns into a failure the day it passes, so the
mark must then be removed. docs/convergence.md has the figures and causes.
"""
import json

import pytest

from hipress import compression

pytest.importorskip("sklearn")

ALGOS = [a for a in compression.available() if a != "none"]
# HiPress's own algorithms (paper 000); every strategy of theirs is in the default suite
CORE = {"onebit", "tbq", "terngrad", "dgc", "graddrop", "powersgd"}


LOWRANK = {a for a in ALGOS if compression.get(a).lowrank}


def strategies_of(algo):
    return ["lowrank"] if algo in LOWRANK else ["ring", "ps", "allgather"]


# Settings for this run's learning rate (0.05, tuned for uncompressed SGD) where the method's
# paper default cannot train it (docs/grace.md, "settings for the bench's step size"); every
# other algorithm runs with its defaults. The sign methods move each element by lr * scale (the
# papers' scale 1 pairs with a learning rate tuned for signs); Random-k with memory sends each
# position once in 1/ratio steps, and at GRACE's 1% those stale bursts diverge (Stich et al.
# bound the step size by the density); GRACE's PowerSGD defaults to rank 1, PowerSGD's paper
# trains at rank 2.
TUNED = {"signsgd": {"scale": 0.05}, "signum": {"scale": 0.05}, "randomk": {"ratio": 0.5},
         "powersgd_grace": {"rank": 2}}

# (algorithm, strategy) -> why it is known to miss the margin (docs/convergence.md, "Open"). The
# slow tests' figures are means over SEEDS (42/1/2) on the AVX-512 VM of 2026-12-06, beside
# uncompressed 98.1 (2 ranks) and 96.6 (4 ranks).
_SIGN = ("a re-encoded sum of signs is the sign of the sum: a majority vote that drops the magnitude "
         "(auto uses allgather; docs/grace.md)")
KNOWN_2 = {("efsignsgd", "ring"): "94.3 (-3.8): one bit with a mean-|x| scale cannot carry a re-encoded sum (auto "
                                  "uses allgather; onebit with its norm-preserving scale passes: docs/convergence.md, "
                                  "cause 10)",
           ("adaq", "ps"): "88.8 (-9.3): the aggregator re-encodes the sum at AdaQ's 1% density (docs/convergence.md, "
                           "cause 4; auto uses allgather, 97.8)",
           ("signsgd", "ring"): "86.4 (-11.7): " + _SIGN, ("signsgd", "ps"): "85.4 (-12.7): " + _SIGN,
           ("signum", "ps"): "85.3 (-12.8): " + _SIGN}
KNOWN_4 = {"efsignsgd": "94.5 (-2.1): one mean-|x| scale per tensor, as onebit before causes 10 and 12",
           # GRACE's sparsifiers and PowerSGD (docs/grace.md)
           "randomk": "87.1 (-9.5) at ratio 0.5: stale bursts of memory (docs/grace.md)",
           "powersgd_grace": "91.6 (-5.1) at rank 2: no warm start of Q (docs/grace.md)",
           "adaq": "91.1 (-5.5): per-sign means at 1% density", "dgc_grace": "94.8 (-1.8): 1% density in 110 steps",
           "topk": "94.7 (-1.9): 1% density in 110 steps"}


def _accuracies(tmp_dir, np, strategy, algos, ddp=False, kwargs=TUNED, seeds=None):
    """{algo: (final test accuracy, the strategy it ran)}, "none" included, from one bench launch;
    with ``seeds``, one launch per seed and each algorithm's mean over them (a failed or diverged
    run counts as NaN, which fails every margin)."""
    from hipress.bench import convergence

    args = ["--task", "digits", "--np", str(np), "--strategy", strategy, "--algos", ",".join(["none"] + algos),
            "--out-dir", str(tmp_dir), "--no-plots", "--timeout", "600", "--no-reference"] \
        + [f"--kwargs={a}={json.dumps(kwargs[a])}" for a in algos if a in kwargs] + (["--ddp"] if ddp else []) \
        + (["--seeds", ",".join(map(str, seeds))] if seeds else [])
    doc = convergence.main(args)
    if seeds:
        return {r["algorithm"]: (r["mean test_accuracy"], f"{strategy}, mean of seeds {seeds}")
                for r in doc["rows"] if r["side"] == "hipress"}
    out = {}
    for algo, r in doc["runs"].items():
        assert "error" not in r, f"{algo}: {r.get('error')}\n{r.get('output_tail')}"
        out[algo] = (r["points"][-1]["test_accuracy"], r["strategy"])
    return out


def _per_strategy(algos):
    # multi-round algorithms run their own (low-rank) strategy whatever is asked: once
    return [(s, [a for a in algos if s in strategies_of(a) or (s == "ring" and a in LOWRANK)])
            for s in ("ring", "ps", "allgather")]


# Algorithms per bench launch. A test runs (or reuses) the one launch that holds its case, so
# one launch must fit a test's timeout on a loaded 2-core machine: the bench trains a launch's
# algorithms one after another in the same ranks, about 3 s each after about 8 s to start them.
_CHUNK = 12


def _launches(per_strategy, ddp=False):
    """[(strategy, algos, ddp)], one bench launch each, with uncompressed beside them; ddp: through
    torch DDP and hipress's comm hook instead of the optimizer."""
    return [(s, tuple(algos[i:i + _CHUNK]), ddp) for s, algos in per_strategy for i in range(0, len(algos), _CHUNK)]


OTHERS = [a for a in ALGOS if a not in CORE]
# (algorithm, strategy) judged by the mean over SEEDS instead of seed 42 alone: at seed 42 they sit at
# the margin and move with the CPU (the same code, 2 ranks, -march=native and torch's kernels
# rounding differently): efsignsgd under auto 95.3 vs 98.3, one image short, on an AVX2 machine and
# passing on an AVX-512 one; graddrop and onebit on PS passing on the AVX2 machine and 95.0 vs 98.3
# on an AVX-512 one. Over seeds 42, 1, 2: efsignsgd -1.35 (docs/grace.md); on the AVX-512 machine
# graddrop/PS -1.12, onebit/PS -1.23 (python -m hipress.bench.convergence --task digits --np 2
# --strategy ps --algos none,graddrop,onebit --seeds 42,1,2).
SEEDS = (42, 1, 2)
BY_SEED_MEAN = {(a, s) for a, s in (("efsignsgd", "auto"), ("graddrop", "ps"), ("onebit", "ps")) if a in ALGOS}
DEFAULT_LAUNCHES = _launches([(s, [a for a in algos if (a, s) not in BY_SEED_MEAN])
                              for s, algos in _per_strategy(sorted(CORE & set(ALGOS)))]
                             + [("auto", [a for a in OTHERS if (a, "auto") not in BY_SEED_MEAN])])
SLOW_LAUNCHES = _launches(_per_strategy(OTHERS))
DDP_LAUNCHES = _launches([("auto", sorted(CORE & set(ALGOS)))], ddp=True)
_done = {}  # (ranks, launch, seeds) -> {algo: accuracy} with "none", or the error it ended with


def _ranks(np, tmp_path_factory, launches, algo, strategy, seeds=None):
    """(accuracy of algo, uncompressed accuracy of the same launch) at np ranks; with ``seeds``,
    both as means over them."""
    launch = next(l for l in launches if algo in l[1] and strategy in (l[0], "lowrank"))
    key = (np, launch, seeds)
    if key not in _done:
        try:
            got = _accuracies(tmp_path_factory.mktemp(launch[0]), np, launch[0], list(launch[1]), ddp=launch[2],
                              seeds=seeds)
            _done[key] = {a: acc for a, (acc, _) in got.items()}
        except Exception as e:  # every case of this launch reports it; none relaunches it
            _done[key] = e
    res = _done[key]
    if isinstance(res, Exception):
        pytest.fail(f"{np}-rank launch {launch} failed: {res}", pytrace=False)
    return res[algo], res["none"]


def _two_rank(tmp_path_factory, launches, algo, strategy):
    return _ranks(2, tmp_path_factory, launches, algo, strategy)


CASES = [(a, s) for a in ALGOS for s in (strategies_of(a) if a in CORE else ["auto"]) if (a, s) not in BY_SEED_MEAN]
OTHER_CASES = [(a, s) for a in OTHERS for s in strategies_of(a)]


def _case(a, s):
    return pytest.param(a, s, marks=pytest.mark.xfail(reason=KNOWN_2[(a, s)], strict=True)) if (a, s) in KNOWN_2 \
        else pytest.param(a, s)


def _within_3(accuracies, algo, strategy):
    acc, base = accuracies
    assert acc >= base - 3.0, f"{algo} ({strategy}): {acc:.1f}% vs uncompressed {base:.1f}%"


@pytest.mark.parametrize("algo,strategy", [_case(a, s) for a, s in CASES])
def test_two_ranks_within_3_points(tmp_path_factory, algo, strategy):
    _within_3(_two_rank(tmp_path_factory, DEFAULT_LAUNCHES, algo, strategy), algo, strategy)


@pytest.mark.parametrize("strategy", sorted({s for _, s in BY_SEED_MEAN}))
def test_two_ranks_mean_of_seeds_within_3_points(tmp_path, strategy):
    algos = sorted(a for a, s in BY_SEED_MEAN if s == strategy)
    mean = _accuracies(tmp_path, 2, strategy, algos, seeds=SEEDS)
    for algo in algos:
        _within_3((mean[algo][0], mean["none"][0]), algo, f"{strategy}, mean of seeds {SEEDS}")


@pytest.mark.parametrize("algo", sorted(CORE & set(ALGOS)))
def test_ddp_hook_two_ranks_within_3_points(tmp_path_factory, algo):
    """The same rule through torch DDP and hipress's comm hook, strategy "auto", momentum
    correction in the hook (docs/ddp.md)."""
    _within_3(_two_rank(tmp_path_factory, DDP_LAUNCHES, algo, "auto"), algo, "auto (DDP hook)")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("algo,strategy", [_case(a, s) for a, s in OTHER_CASES])
def test_two_ranks_every_strategy_within_3_points(tmp_path_factory, algo, strategy):
    """Judged by the mean over SEEDS: at seed 42 alone adaq on ring and PS missed by 0.03 and 1.4
    points on this AVX-512 machine, and signum on ring passed; all three moved with the seed."""
    _within_3(_ranks(2, tmp_path_factory, SLOW_LAUNCHES, algo, strategy, SEEDS), algo,
              f"{strategy}, mean of seeds {SEEDS}")


@pytest.mark.parametrize("ddp,wire,interval", [(False, "fp32", 4), (True, "fp32", 4), (False, "bf16", 4),
                                               (False, "bf16", 16)],
                         ids=["optimizer", "ddp-hook", "optimizer-bf16", "optimizer-bf16-i16"])
def test_covap_two_ranks_within_3_points(tmp_path, ddp, wire, interval):
    """compression="covap" (docs/covap.md), its default local mode, at a fixed interval (the
    profiled one depends on the machine's timing): 4, every parameter averaged once in 4 steps, and
    16, the fastest configuration on VGG19-like at 1 Gbit/s here (docs/benchmarks.md, session 73);
    its averages as fp32 parameters (default) or bf16 differences. The paper's form
    (mode="paper") ends at 46.5% here, against 98.3% uncompressed."""
    got = _accuracies(tmp_path, 2, "auto", ["covap"], ddp=ddp, kwargs={"covap": {"interval": interval, "wire": wire}})
    _within_3((got["covap"][0], got["none"][0]), "covap", "auto (DDP hook)" if ddp else "auto")


# the digits CNN's one bucket, forced compressed: on loopback the model's own plan compresses nothing
# (compressing does not pay there), which would leave nothing to test
DIGITS_BUCKET = "fused[fc2.bias..conv1.weight]"


@pytest.mark.parametrize("strategy,runs", [("auto", ("ps", "allgather")), ("ps", ("ps",)),
                                           ("allgather", ("allgather",))])
def test_compression_auto_four_ranks_within_3_points(tmp_path, strategy, runs):
    """compression="auto": TernGrad where the planner says it pays (here forced), the plan measured
    in the first steps against compressing nothing (hipress/torch/plan_trial.py); which plan is kept
    depends on the machine's timing, so the rule must hold for either (digits, seed 42; docs/convergence.md).
    The strategy column says which, and which strategy "auto" chose under the plan (PS or allgather,
    whichever the model predicts faster)."""
    got = _accuracies(tmp_path, 4, strategy, ["auto"], kwargs={"auto": {"plan": {"force": {DIGITS_BUCKET: True}}}})
    assert got["auto"][1].startswith(runs), got["auto"]
    assert "plan kept" in got["auto"][1], f"the model's plan compressed nothing: {got['auto']}"
    _within_3((got["auto"][0], got["none"][0]), "auto", got["auto"][1])


# 4 ranks, strategy "auto": like the 2-rank launches, at most _CHUNK algorithms per launch (one
# launch of all of them ran past the 300 s test timeout in its fixture).
FOUR_RANK_LAUNCHES = _launches([("auto", ALGOS)])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("algo", [pytest.param(a, marks=pytest.mark.xfail(reason=KNOWN_4[a], strict=True))
                                  if a in KNOWN_4 else a for a in ALGOS])
def test_four_ranks_auto_within_1_point(tmp_path_factory, algo):
    """At least uncompressed - 1 point, by the mean over SEEDS. At seed 42 alone DGC, onebit and
    threshold ended 3 test images (1.01 points) under uncompressed on this AVX-512 machine, TBQ 5,
    and their means over the three seeds were 0.11-0.56 under (docs/convergence.md). Above
    uncompressed is not a miss (the check was two-sided before: onebit at seed 2 was 1.01 above)."""
    acc, base = _ranks(4, tmp_path_factory, FOUR_RANK_LAUNCHES, algo, "auto", SEEDS)
    assert acc >= base - 1.0, f"{algo}: {acc:.2f}% vs uncompressed {base:.2f}% (means of seeds {SEEDS})"
