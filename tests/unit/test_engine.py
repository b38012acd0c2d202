import json
import random
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from hipress import _C
from hipress.engine import Engine, EngineShutdownError, TaskError, TaskTimeout


@pytest.fixture
def engine():
    e = Engine()
    yield e
    e.shutdown(drain=False)


def test_diamond_python_tasks(engine):
    order = []
    a = engine.submit("a", lambda: order.append("a") or 1)
    b = engine.submit("b", lambda: order.append("b"), queue="comm", deps=[a])
    c = engine.submit("c", lambda: order.append("c"), deps=[a])
    d = engine.submit("d", lambda: order.append("d") or "done", queue="comm", deps=[b, c])
    assert d.result(timeout=5) == "done"
    assert a.result() == 1
    assert order[0] == "a" and order[-1] == "d" and sorted(order[1:3]) == ["b", "c"]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_dag_runs_in_topological_order(seed):
    rng = random.Random(seed)
    n = 300
    eng = Engine()
    lock = threading.Lock()
    order = []
    handles, deps = [], []
    for i in range(n):
        parents = rng.sample(range(i), k=min(i, rng.randint(0, 3)))
        deps.append(parents)

        def body(i=i):
            with lock:
                order.append(i)

        # Mix native and Python work on both queues.
        work = body if rng.random() < 0.7 else _C.native_noop()
        handles.append(eng.submit(f"t{i}", work, queue=rng.choice(["compute", "comm"]),
                                  deps=[handles[p] for p in parents]))
    eng.shutdown(drain=True, timeout=30)
    assert all(h.state == "done" for h in handles)
    pos = {t: k for k, t in enumerate(order)}
    for i, parents in enumerate(deps):
        if i in pos:  # native tasks do not record
            for p in parents:
                if p in pos:
                    assert pos[p] < pos[i]


def _rendezvous(mine, other, timeout=30):
    """A task body that says it runs, then waits (up to timeout) until the other one runs:
    both return True only if they ran at the same time. Waiting on an Event frees the GIL."""
    def body():
        mine.set()
        return other.wait(timeout)
    return body


def test_compute_and_comm_overlap(engine):
    # Load-proof: no durations are compared (a 150 ms overlap of timed tasks once stood here;
    # a loaded machine can start the second queue late). Each task waits until the other
    # runs: a serial engine would leave the first waiting out its 30 s and returning False.
    a, b = threading.Event(), threading.Event()
    comp = engine.submit("encode", _rendezvous(a, b))
    comm = engine.submit("send", _rendezvous(b, a), queue="comm")
    assert comp.result(60) is True and comm.result(60) is True, "the two queues did not run at once"


@pytest.mark.parametrize("busy,native", [("compute", "comm"), ("comm", "compute")])
def test_native_task_runs_while_the_other_queue_is_busy(engine, busy, native):
    # Load-proof: the busy queue's task ends only once the native task on the other queue
    # has finished (or after 30 s, returning False), so True shows they ran at the same time.
    handle, known = [], threading.Event()

    def hold():
        return known.wait(30) and handle[0].wait(30)

    holder = engine.submit("hold", hold, queue=busy)
    work = _C.native_spin(1000) if native == "compute" else _C.native_sleep(1000)
    handle.append(engine.submit("native", work, queue=native))
    known.set()
    assert holder.result(60) is True and handle[0].state == "done"


def test_python_task_releases_gil_between_tasks(engine):
    # The main thread keeps running Python while the engine runs Python tasks.
    hs = [engine.submit(f"py{i}", lambda: sum(range(1000))) for i in range(200)]
    spins = 0
    while not hs[-1].poll():
        spins += 1
    assert hs[-1].result(5) == sum(range(1000))


def test_failure_propagates_with_name_and_message(engine):
    def boom():
        raise ValueError("bad gradient")

    a = engine.submit("encode.fc1", boom)
    b = engine.submit("send.fc1", lambda: None, queue="comm", deps=[a])
    c = engine.submit("decode.fc1", lambda: None, deps=[b])
    with pytest.raises(TaskError) as ei:
        c.result(timeout=5)
    msg = str(ei.value)
    assert "decode.fc1" in msg and "send.fc1" in msg and "ValueError: bad gradient" in msg
    with pytest.raises(TaskError, match="encode.fc1.*ValueError: bad gradient"):
        a.result()
    assert engine.counters()["dependency_failed"] == 2


def test_native_failure(engine):
    h = engine.submit("kernel", _C.native_fail("out of bounds"))
    assert isinstance(h.exception(5), TaskError)
    assert "out of bounds" in str(h.exception())


def test_wait_with_timeout_returns(engine):
    # Load-proof: the task cannot finish before the gate opens (after the waits below), so
    # False from wait(0.05) shows its timeout ended the wait; a wait that ignored it would
    # block until the task gave up after 30 s and return True. No elapsed time is compared.
    gate = threading.Event()
    h = engine.submit("slow", lambda: gate.wait(30), queue="comm")
    assert h.wait(timeout=0.05) is False
    with pytest.raises(TaskTimeout):
        h.result(timeout=0.01)
    assert not h.poll()
    gate.set()
    assert h.wait(timeout=30) and h.result() is True


def test_submit_after_shutdown_is_clear_error():
    e = Engine()
    e.shutdown()
    with pytest.raises(EngineShutdownError, match="shut down"):
        e.submit("late", lambda: None)
    e.shutdown()  # idempotent


def test_shutdown_cancels_pending():
    # Load-proof: the running task holds its queue until shutdown has cancelled the task
    # queued behind it (a helper thread opens its gate then), however late this thread
    # gets to call shutdown (a 200 ms sleep once held the queue, which load could outlast).
    e = Engine()
    gate = threading.Event()
    slow = e.submit("slow", lambda: gate.wait(30), queue="comm")
    queued = e.submit("queued", lambda: None, queue="comm")
    dep = e.submit("dep", lambda: None, deps=[slow])
    deadline = time.time() + 30
    while slow.state != "running" and time.time() < deadline:
        time.sleep(0.001)
    assert slow.state == "running"

    def open_gate_once_cancelled():
        end = time.time() + 30
        while queued.state != "cancelled" and time.time() < end:
            time.sleep(0.001)
        gate.set()

    opener = threading.Thread(target=open_gate_once_cancelled)
    opener.start()
    e.shutdown(drain=False)
    opener.join()
    assert slow.state == "done"
    assert queued.state == "cancelled" and dep.state == "cancelled"
    with pytest.raises(TaskError, match="cancelled"):
        queued.result(0)


def test_future(engine):
    fut = engine.submit("f", lambda: 41 + 1).future()
    assert fut.wait() == 42
    bad = engine.submit("g", _C.native_fail("nope")).future()
    with pytest.raises(Exception, match="nope"):
        bad.wait()


def test_counters(engine):
    hs = [engine.submit(f"c{i}", _C.native_spin(200)) for i in range(10)]
    hs += [engine.submit(f"m{i}", _C.native_sleep(200), queue="comm") for i in range(5)]
    for h in hs:
        h.wait(5)
    c = engine.counters()
    assert c["compute"]["tasks_run"] == 10 and c["comm"]["tasks_run"] == 5
    assert c["compute"]["busy_s"] >= 10 * 200e-6
    assert c["comm"]["busy_s"] >= 5 * 200e-6
    assert c["submitted"] == 15 and c["live"] == 0


def test_timeline_is_chrome_trace(tmp_path):
    path = tmp_path / "timeline.json"
    e = Engine(str(path), rank=3)
    # the two slices overlap whatever the load: each body waits until the other runs
    ea, eb = threading.Event(), threading.Event()
    a = e.submit("encode.w", lambda: _rendezvous(ea, eb)() and time.sleep(0.02))  # >= 20 ms
    b = e.submit("send.w", _rendezvous(eb, ea), queue="comm")
    e.submit("decode.w", lambda: None, deps=[a, b]).wait(60)
    assert a.state == b.state == "done" and b.result() is True
    e.shutdown()
    events = json.loads(path.read_text())
    names = {ev["args"]["name"] for ev in events if ev["ph"] == "M"}
    assert names == {"Q_comp", "Q_commu"}
    slices = {ev["name"]: ev for ev in events if ev["ph"] == "X"}
    assert set(slices) == {"encode.w", "send.w", "decode.w"}
    assert slices["send.w"]["tid"] == 1 and slices["encode.w"]["tid"] == 0
    assert all(ev["pid"] == 3 for ev in slices.values())
    assert slices["encode.w"]["dur"] >= 20_000 * 0.9  # µs
    enc, snd = slices["encode.w"], slices["send.w"]
    assert min(enc["ts"] + enc["dur"], snd["ts"] + snd["dur"]) > max(enc["ts"], snd["ts"])  # overlapped


LAUNCHERS = {  # the variables each launcher sets for rank 2 of 4
    "mpirun": {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
    "torchrun": {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2"},
    "horovodrun": {"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "2"},
    "mpich": {"PMI_RANK": "2", "PMI_SIZE": "4"},
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_process_engine_timeline_pid_is_the_launch_rank(tmp_path, launcher):
    """get_engine() with HIPRESS_TIMELINE names the trace and sets its pid from the rank the
    launcher gave (mpirun sets no RANK), without hipress.init()."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "HOROVOD_", "HIPRESS_")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(LAUNCHERS[launcher], HIPRESS_TIMELINE=str(tmp_path / "tl.{rank}.json"))
    code = ("import hipress\n"
            "e = hipress.get_engine()\n"
            "e.submit('encode.w', lambda: None).wait(5)\n"
            "hipress.engine.shutdown_engine()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tl.2.json"]
    events = json.loads((tmp_path / "tl.2.json").read_text())
    assert {ev["pid"] for ev in events if ev["ph"] == "X"} == {2}


def test_bad_arguments(engine):
    with pytest.raises(ValueError, match="unknown queue"):
        engine.submit("x", lambda: None, queue="gpu")
    with pytest.raises(TypeError):
        engine.submit("x", 42)
    with pytest.raises(TypeError):
        engine.submit("x", lambda: None, deps=["a"])


def test_safe_at_interpreter_exit(tmp_path):
    # Tasks still queued at exit: the process ends promptly and cleanly.
    import subprocess
    import sys
    code = ("import hipress\n"
            "e = hipress.get_engine()\n"
            "from hipress import _C\n"
            "[e.submit(f't{i}', _C.native_sleep(1000), queue='comm') for i in range(50)]\n"
            "[e.submit(f'p{i}', lambda: None) for i in range(50)]\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_deferred_task_completes_from_another_thread(engine):
    posted = []
    a = engine.submit("encode", lambda: 1)
    d = engine.submit_deferred("bulk.send", posted.append, deps=[a])
    after = engine.submit("decode", lambda: "ran", deps=[d])
    deadline = time.time() + 30
    # the work appends the completion and then returns: only then is the task "posted"
    while (not posted or d.state != "posted") and time.time() < deadline:
        time.sleep(0.001)
    assert posted and d.state == "posted" and not after.poll()
    threading.Thread(target=posted[0].done).start()
    assert after.result(timeout=5) == "ran" and d.state == "done"


def test_deferred_task_failure_and_early_completion(engine):
    d = engine.submit_deferred("bulk.recv", lambda c: c.fail("peer 3 vanished"))  # completes inside post
    dep = engine.submit("decode", lambda: None, deps=[d])
    with pytest.raises(TaskError, match="bulk.recv.*peer 3 vanished"):
        dep.result(timeout=5)
    ok = engine.submit_deferred("early", lambda c: c.done())
    assert ok.wait(5) and ok.state == "done"
    with pytest.raises(RuntimeError, match="state done"):
        engine._engine.complete(ok.native, True, "")


def test_shutdown_cancels_posted_deferred_tasks():
    e = Engine()
    d = e.submit_deferred("never", lambda c: None)
    deadline = time.time() + 30
    while d.state != "posted" and time.time() < deadline:
        time.sleep(0.001)
    e.shutdown(drain=False)
    assert d.state == "cancelled"


def test_batched_tasks_run_as_one_batch(tmp_path):
    path = tmp_path / "tl.json"
    e = Engine(str(path))
    # holds the queue until the whole batch has queued up (a 30 ms sleep once did: load
    # could end it before the last task was submitted, splitting the batch)
    opened = threading.Event()
    gate = e.submit("gate", lambda: opened.wait(30))
    order = []
    hs = [e.submit(f"encode.g{i}", (lambda i=i: order.append(i)), deps=[gate], batch="encode") for i in range(10)]
    hs.append(e.submit("decode.x", lambda: order.append("d"), deps=[gate]))
    opened.set()
    assert gate.result(timeout=30) is True
    for h in hs:
        h.result(timeout=5)
    c = e.counters()["compute"]
    e.shutdown()
    assert order == list(range(10)) + ["d"]
    assert c["batches"] >= 1 and c["tasks_run"] == 12
    names = [ev["name"] for ev in json.loads(path.read_text()) if ev["ph"] == "X"]
    assert any(n.startswith("batch[10] encode.g0 .. encode.g9") for n in names), names


def test_batch_member_failure_is_its_own(engine):
    gate = engine.submit("gate", _C.native_sleep(20_000))
    ok1 = engine.submit("encode.a", lambda: 1, deps=[gate], batch="encode")
    bad = engine.submit("encode.b", _C.native_fail("bad tensor"), deps=[gate], batch="encode")
    ok2 = engine.submit("encode.c", lambda: 3, deps=[gate], batch="encode")
    assert ok1.result(5) == 1 and ok2.result(5) == 3
    with pytest.raises(TaskError, match="encode.b.*bad tensor"):
        bad.result(5)
