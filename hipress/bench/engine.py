"""Engine microbenchmark: per-task overhead and queue throughput.

    python -m hipress.bench.engine [--tasks 200000] [--out results/engine.json]

Figures:
  native_cpp_*      no-op native tasks submitted from C++ (pure engine cost)
  native_from_py    no-op native tasks submitted from Python (adds the binding)
  python_task       no-op Python callables (adds taking the GIL on the queue thread)
  throughput_*      50 µs busy tasks with one queue busy versus both queues busy;
                    the ratio shows the two queue threads really run at once
Goals (issue 2): native overhead < 5 µs, Python task < 30 µs.
"""
from __future__ import annotations

import argparse
import time

from hipress import _C
from hipress.bench.common import markdown_table, write_result
from hipress.engine import Engine


def _python_submitted(n: int, make_work, queues: int = 1) -> float:
    eng = Engine()
    qs = ["compute", "comm"][:queues]
    t0 = time.perf_counter()
    for i in range(n):
        eng.submit("t", make_work(), queue=qs[i % queues])
    eng.shutdown(drain=True)
    return time.perf_counter() - t0


def run(tasks: int, busy_us: float, busy_tasks: int) -> list[dict]:
    rows = []

    def add(name, seconds, n, what):
        rows.append({"figure": name, "tasks": n, "seconds": seconds, "us_per_task": seconds / n * 1e6,
                     "tasks_per_s": n / seconds, "what": what})

    s, n = _C.bench_native_tasks(tasks, 1, False)
    add("native_cpp_independent", s, n, "no-op native tasks from C++, one queue")
    s, n = _C.bench_native_tasks(tasks // 4, 2, True)
    add("native_cpp_chained_2q", s, n, "each task depends on the previous, alternating queues")
    s = _python_submitted(tasks // 2, _C.native_noop)
    add("native_from_py", s, tasks // 2, "no-op native tasks submitted from Python")
    s = _python_submitted(tasks // 4, lambda: (lambda: None))
    add("python_task", s, tasks // 4, "no-op Python callables")
    for queues in (1, 2):
        s = _python_submitted(busy_tasks, lambda: _C.native_spin(busy_us), queues)
        add(f"throughput_{queues}q", s, busy_tasks, f"{busy_us:g} us busy native tasks over {queues} queue(s)")
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=int, default=200_000)
    p.add_argument("--busy-us", type=float, default=50.0)
    p.add_argument("--busy-tasks", type=int, default=4000)
    p.add_argument("--out", default="results/engine.json")
    a = p.parse_args(argv)
    rows = run(a.tasks, a.busy_us, a.busy_tasks)
    by = {r["figure"]: r for r in rows}
    summary = {
        "native_overhead_us": by["native_cpp_independent"]["us_per_task"],
        "python_task_overhead_us": by["python_task"]["us_per_task"],
        "two_queue_speedup": by["throughput_2q"]["tasks_per_s"] / by["throughput_1q"]["tasks_per_s"],
        "goal_native_us": 5.0,
        "goal_python_us": 30.0,
    }
    print(markdown_table(rows, ["figure", "tasks", "us_per_task", "tasks_per_s", "what"]))
    print(f"\nnative overhead {summary['native_overhead_us']:.2f} us (goal < 5), "
          f"python task {summary['python_task_overhead_us']:.2f} us (goal < 30), "
          f"2-queue throughput x{summary['two_queue_speedup']:.2f} vs 1 queue")
    write_result(a.out, "engine", vars(a), rows, {"summary": summary})
    return summary


if __name__ == "__main__":
    main()
