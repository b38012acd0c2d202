"""CompLL's generated CUDA kernels on a GPU: encode and decode throughput against a device copy.

    python -m hipress.bench.cuda_kernels [--sizes 16,64,256] [--repeat 20] [--out results/cuda_kernels.json]

For each shipped spec without a matrix view (PowerSGD-like specs have no CUDA back end), the gradient
(random normal, fp32, the given sizes in MB) is encoded and the payload decoded on the current GPU,
each timed with CUDA events over `--repeat` calls after a warm-up; the baseline is a device-to-device
copy of the same bytes measured in the same run. GB/s counts the gradient's bytes (one side), as
hipress.bench.kernels does on the CPU. Needs torch with CUDA and nvcc (the specs are compiled here).
"""
import argparse
import json
import os
import statistics

import torch

from hipress import compll


def _time(fn, repeat):
    """Median milliseconds of fn() over repeat calls, CUDA events around each."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run(sizes_mb, repeat):
    specs = compll.cuda_specs()
    rows = []
    for mb in sizes_mb:
        n = int(mb * (1 << 20)) // 4
        g = torch.randn(n, device="cuda")
        dst = torch.empty_like(g)
        copy_ms = _time(lambda: dst.copy_(g), repeat)
        gbps = lambda ms: n * 4 / ms / 1e6  # noqa: E731
        rows.append({"spec": "copy", "mb": mb, "encode_gbps": gbps(copy_ms), "decode_gbps": gbps(copy_ms)})
        for s in specs:
            c = compll.load(s, name=f"bench_{s}", register=False)()
            state = c.new_state(n)
            for k, b in list(state.buffers.items()):
                state.buffers[k] = b.cuda()
            payload = c.encode(g, state).clone()
            out = torch.empty_like(g)
            enc = _time(lambda: c.encode(g, state), repeat)
            dec = _time(lambda: c.decode(payload, out), repeat)
            rows.append({"spec": s, "mb": mb, "encode_gbps": gbps(enc), "decode_gbps": gbps(dec),
                         "encode_of_copy": copy_ms / enc, "decode_of_copy": copy_ms / dec,
                         "payload_bytes": int(payload.numel()), "ratio": n * 4 / max(1, payload.numel())})
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,64,256", help="gradient sizes in MB (comma separated)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default="results/cuda_kernels.json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("hipress.bench.cuda_kernels needs a CUDA GPU (torch.cuda.is_available() is False)")
    res = run([float(x) for x in a.sizes.split(",")], a.repeat)
    print(f"{res['device']}, torch {res['torch']}")
    print(f"{'spec':<16}{'MB':>6}{'encode GB/s':>13}{'x copy':>8}{'decode GB/s':>13}{'x copy':>8}{'ratio':>8}")
    for r in res["rows"]:
        print(f"{r['spec']:<16}{r['mb']:>6g}{r['encode_gbps']:>13.1f}{r.get('encode_of_copy', 1):>8.3f}"
              f"{r['decode_gbps']:>13.1f}{r.get('decode_of_copy', 1):>8.3f}{r.get('ratio', 1):>8.1f}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
