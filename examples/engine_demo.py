"""Runs a small CaSync-shaped task graph on the engine and writes its timeline.

    python examples/engine_demo.py [--layers 8] [--timeline results/engine_demo_timeline.json]

Per layer: encode (compute queue, native) -> send (comm queue) -> decode (compute,
Python). Encodes of later layers run while earlier layers are still "on the wire",
which the printed overlap figure and the timeline (open it in Perfetto) show.
"""
import argparse
import os

from hipress import _C
from hipress.engine import Engine


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--timeline", default="results/engine_demo_timeline.json")
    a = p.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(a.timeline)), exist_ok=True)
    eng = Engine(a.timeline)
    decoded = []
    last = []
    for i in range(a.layers):
        enc = eng.submit(f"encode.layer{i}", _C.native_spin(4000))
        snd = eng.submit(f"send.layer{i}", _C.native_sleep(6000), queue="comm", deps=[enc])
        last.append(eng.submit(f"decode.layer{i}", lambda i=i: decoded.append(i), deps=[snd]))
    for h in last:
        h.result(timeout=30)
    c = eng.counters()
    eng.shutdown()
    busy = c["compute"]["busy_s"] + c["comm"]["busy_s"]
    print(f"ran {c['submitted']} tasks; decoded layers {decoded}")
    print(f"compute busy {c['compute']['busy_s'] * 1e3:.1f} ms, comm busy {c['comm']['busy_s'] * 1e3:.1f} ms, "
          f"sum {busy * 1e3:.1f} ms")
    print(f"timeline: {a.timeline} (open in https://ui.perfetto.dev or chrome://tracing)")


if __name__ == "__main__":
    main()
