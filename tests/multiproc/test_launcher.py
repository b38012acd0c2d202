"""hipress.launch's supervision (hipress.supervise): exit codes, timeout, signals; nothing is left running."""
import os
import signal
import subprocess
import sys
import time

import pytest
from example_run import ROOT, as_from_a_terminal, clean_env, procs_with, running

from hipress.launch import run

PY = sys.executable


def _gone(marker, within=30.0):  # polled: a generous bound costs nothing when teardown is prompt
    deadline = time.time() + within
    while procs_with(marker) and time.time() < deadline:
        time.sleep(0.05)
    return not procs_with(marker)


@pytest.mark.timeout(120)
def test_failing_rank_code_stops_the_others_and_their_children():
    # the others sleep far past the timeout, so only being stopped ends them early: the exit
    # code says so whatever the load (no wall-clock bound)
    marker = f"71.{os.getpid()}1"
    script = ("import os, subprocess, sys, time\n"
              f"subprocess.Popen(['sleep', '{marker}'])  # stays in the rank's process group\n"
              "if os.environ['RANK'] == '1':\n    time.sleep(0.5); sys.exit(3)\n"
              "time.sleep(600); print('finished', flush=True)\n")
    code, outs = run([PY, "-c", script], 3, timeout=60, quiet=True)
    assert code == 3, outs  # (had the others been waited for, the 60 s timeout would have said 124)
    assert not any("finished" in o for o in outs), outs  # the others were stopped, not run to the end
    assert _gone(marker)


@pytest.mark.timeout(120)
def test_rank_killed_by_a_signal_reports_128_plus_n_and_timeout_124():
    code, _ = run([PY, "-c", "import os, signal, time\n"
                   "if os.environ['RANK'] == '0':\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(600)"],
                  2, timeout=60, quiet=True)
    assert code == 128 + signal.SIGKILL
    # the timeout leaves both ranks time to start and print under load (it was 1.5 s, which a
    # slow interpreter start on a loaded machine could use up before 'hi')
    code, outs = run([PY, "-c", "import os; print('hi', os.environ['RANK'], flush=True); import time; time.sleep(600); "
                          "print('finished', flush=True)"], 2, timeout=10, quiet=True)
    assert code == 124
    assert [o.split() for o in outs] == [["hi", "0"], ["hi", "1"]]  # stopped at the timeout: no 'finished'


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig,expected", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_cli_signal_stops_every_rank(sig, expected):
    marker = f"72.{os.getpid()}{int(sig)}"
    p = subprocess.Popen([PY, "-m", "hipress.launch", "-np", "2", "sleep", marker], cwd=ROOT, env=clean_env("30"),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=as_from_a_terminal)
    try:
        # polled, so a generous bound costs nothing when the start is prompt: the launcher imports
        # torch, which took over 20 s in a CI run beside a busy loop and five other jobs
        deadline = time.time() + 120
        # both ranks exec'd `sleep` (counting every process with the marker, the CLI included,
        # raced with a rank still between fork and exec: 4 seen once under load)
        while time.time() < deadline and len(running("sleep", marker)) < 2:
            time.sleep(0.05)
        assert len(running("sleep", marker)) == 2, ("ranks did not start", procs_with(marker))
        p.send_signal(sig)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == expected, out
    assert _gone(marker)
