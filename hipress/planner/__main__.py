"""python -m hipress.planner --show [...]: print the selective compression/partitioning plan.

Examples:
    python -m hipress.planner --show --sizes 4KB,1MB,64MB --n 16 --rate 0.0625 --bandwidth 10gbit
    python -m hipress.planner --show --example vgg19 --strategy paper_ring
    python -m hipress.planner --show --profile ~/.cache/hipress/profiles/tbq__cuda__n16__paper_ps_colocated.json
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from typing import List, Tuple

from hipress.planner.cost_model import CATEGORIES, STRATEGIES, AffineCurve, CostModel
from hipress.planner.plan import Overrides, make_plan
from hipress.planner.profile import ProfileError, load_profile

_SIZE = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
         "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
_TIME = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_NUM = r"([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)"


def parse_size(s: str) -> int:
    """'4KB' -> 4096 (binary units: KB = KiB = 1024 bytes, as the paper's 4MB/64MB)."""
    m = re.fullmatch(_NUM + r"\s*([a-z]*)", s.strip().lower())
    if not m or m.group(2) not in _SIZE:
        raise argparse.ArgumentTypeError(f"bad size {s!r} (e.g. 4096, 4KB, 1.5MB, 1GB)")
    return int(float(m.group(1)) * _SIZE[m.group(2)])


def parse_rate(s: str) -> float:
    """Bandwidth/throughput in bytes/s: '10gbit', '56Gbps', '7GB/s', '7e9' (bytes/s)."""
    t = s.strip().lower().replace("/s", "ps").replace(" ", "")
    m = re.fullmatch(_NUM + r"([kmgt]?)(bit|bps|b|bytes|)(ps)?", t)
    if not m:
        raise argparse.ArgumentTypeError(f"bad bandwidth {s!r} (e.g. 10gbit, 56Gbps, 7GB/s)")
    v = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    # bits: 'bit', 'bit/s', lower-case 'bps' (56Gbps); bytes: 'B', 'B/s', 'Bps', 'bytes', no unit
    bits = m.group(3) in ("bit", "bps") and not s.strip().endswith(("B/s", "Bps", "B"))
    return v / 8 if bits else v


def parse_time(s: str) -> float:
    m = re.fullmatch(_NUM + r"\s*([a-z]*)", s.strip().lower())
    if not m or m.group(2) not in _TIME:
        raise argparse.ArgumentTypeError(f"bad time {s!r} (e.g. 5us, 0.1ms, 2e-5)")
    return float(m.group(1)) * _TIME[m.group(2)]


def _vgg19() -> List[Tuple[str, int]]:
    chans = [(3, 64), (64, 64), (64, 128), (128, 128), (128, 256)] + [(256, 256)] * 3 + [(256, 512)] + \
            [(512, 512)] * 7
    out = []
    for i, (ci, co) in enumerate(chans):
        out += [(f"features.{i}.weight", 4 * ci * co * 9), (f"features.{i}.bias", 4 * co)]
    for i, (fi, fo) in enumerate([(25088, 4096), (4096, 4096), (4096, 1000)]):
        out += [(f"classifier.{i}.weight", 4 * fi * fo), (f"classifier.{i}.bias", 4 * fo)]
    return out


EXAMPLES = {
    "fig14": lambda: [(f"m={s}", parse_size(s)) for s in
                      "32KB 128KB 256KB 512KB 1MB 4MB 16MB 64MB 128MB".split()],
    "vgg19": _vgg19,
}


def parse_sizes(text: str) -> List[Tuple[str, int]]:
    out = []
    for i, tok in enumerate(t for t in text.split(",") if t.strip()):
        name, _, size = tok.rpartition("=")
        out.append((name.strip() or f"g{i}:{tok.strip()}", parse_size(size)))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hipress.planner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--show", action="store_true", help="print the plan table (the default action)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--sizes", help="comma list of sizes or name=size, e.g. 4KB,1MB,fc=64MB")
    src.add_argument("--example", choices=sorted(EXAMPLES), help="built-in size list (default fig14)")
    p.add_argument("--profile", help="saved profile JSON: use its curves, N, strategy, category and rate")
    g = p.add_argument_group("cluster and algorithm (ignored where --profile gives them)")
    g.add_argument("--n", type=int, default=16, help="workers (ring) or aggregators (ps); default 16")
    g.add_argument("--strategy", choices=STRATEGIES, default=None,
                   help="paper_* rows of the paper's Table 3, or hipress's executed ring / ps / allgather; "
                        "default paper_ps_colocated")
    g.add_argument("--category", choices=CATEGORIES, default="quantization")
    g.add_argument("--rate", type=float, default=1 / 16, help="compressed/original bytes; default 0.0625")
    g = p.add_argument_group("affine curves when no --profile (defaults: the Fig. 14 setting, docs/planner.md)")
    g.add_argument("--bandwidth", type=parse_rate, default=parse_rate("56gbit"), help="link, default 56gbit")
    g.add_argument("--latency", type=parse_time, default=5e-6, help="per message, default 5us")
    g.add_argument("--enc-throughput", type=parse_rate, default=80e9,
                   help="fp32 bytes encoded per second, default 80GB/s")
    g.add_argument("--enc-overhead", type=parse_time, default=100e-6, help="per encode, default 100us")
    g.add_argument("--dec-throughput", type=parse_rate, default=80e9,
                   help="fp32 bytes *produced* per second by decode, default 80GB/s")
    g.add_argument("--dec-overhead", type=parse_time, default=100e-6, help="per decode, default 100us")
    g = p.add_argument_group("pins")
    g.add_argument("--k-max", type=int, default=None, help="max partitions (default N)")
    g.add_argument("--min-compress-bytes", type=parse_size, default=0)
    g.add_argument("--max-compress-bytes", type=parse_size, default=None)
    g.add_argument("--min-partition-bytes", type=parse_size, default=0)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.profile:
        try:
            prof = load_profile(args.profile)
        except ProfileError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        model = prof.cost_model(args.strategy)
        source = f"profile {args.profile} (device {prof.device}, algorithm {prof.algorithm})"
    else:
        r = args.rate
        model = CostModel(AffineCurve.from_throughput(args.bandwidth, args.latency),
                          AffineCurve.from_throughput(args.enc_throughput, args.enc_overhead),
                          AffineCurve.from_throughput(r * args.dec_throughput, args.dec_overhead),
                          args.n, args.strategy or "paper_ps_colocated", args.category, r)
        source = (f"affine curves: link {args.bandwidth * 8 / 1e9:g} Gbit/s + {args.latency * 1e6:g} us; "
                  f"encode {args.enc_throughput / 1e9:g} GB/s + {args.enc_overhead * 1e6:g} us; "
                  f"decode {args.dec_throughput / 1e9:g} GB/s (fp32 out) + {args.dec_overhead * 1e6:g} us")
    grads = parse_sizes(args.sizes) if args.sizes else EXAMPLES[args.example or "fig14"]()
    ov = Overrides(min_compress_bytes=args.min_compress_bytes, max_compress_bytes=args.max_compress_bytes,
                   max_partitions=args.k_max, min_partition_bytes=args.min_partition_bytes)
    plan = make_plan(grads, model, ov)
    try:
        _emit(args, source, plan)
    except BrokenPipeError:  # e.g. piped into head
        sys.stderr.close()
    return 0


def _emit(args, source, plan) -> None:
    if args.json:
        print(json.dumps({"source": source, "entries": plan.to_dicts()}, indent=1, default=str))
    else:
        print(f"# {source}")
        print(plan.table())


if __name__ == "__main__":
    sys.exit(main())
