"""hipress.launch's per-rank environment (the multi-process runs are in tests/multiproc)."""
import os

from hipress.launch import rank_env


def test_rank_env_divides_the_cores_among_ranks_unless_omp_threads_are_set():
    env = rank_env(1, 4, 29500, base={"PATH": "/bin"}, hosts=2)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("1", "4", "1", "2")
    assert env["HIPRESS_HOSTNAME"] == "host0"
    # fake hosts share this machine's cores: divided among all 4 ranks
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 4))
    assert rank_env(0, 64, 29500, base={})["OMP_NUM_THREADS"] == "1"
    assert rank_env(0, 2, 29500, base={"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"


def test_cli_takes_the_command_after_a_double_dash(tmp_path):
    # `python -m hipress.launch -np 2 -- cmd` as `python -m hipress.bench.cluster` takes it: "--" is
    # not the program (it used to be, and Popen failed with "No such file or directory: '--'")
    import subprocess
    import sys

    out = tmp_path / "ranks"
    out.mkdir()
    code = "import os, pathlib, sys; pathlib.Path(sys.argv[1], os.environ['RANK']).write_text('ran')"
    done = subprocess.run([sys.executable, "-m", "hipress.launch", "-np", "2", "--timeout", "60", "--",
                           sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["0", "1"]
