"""`dsv3 bench NAME --json`: one JSON object with our figure, the baseline's measured in the same run and
their `ratio` (ours / baseline, > 1 is better); machine facts under `env`.

Each bench is a module `dsv3_plugin.bench.<name>` with `add_arguments(parser)` and `run(args) -> dict`.
"""

import importlib
import json
import pkgutil

from dsv3_plugin import bench as bench_pkg
from dsv3_plugin.bench import env_facts


def register(sub):
    p = sub.add_parser("bench", help="measure a figure against its baseline in the same run")
    bsub = p.add_subparsers(dest="bench", metavar="NAME")
    bsub.required = True
    for info in sorted(pkgutil.iter_modules(bench_pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{bench_pkg.__name__}.{info.name}")
        name = info.name.replace("_", "-")  # module fp8_accum -> `dsv3 bench fp8-accum` (the old spelling too)
        bp = bsub.add_parser(
            name, aliases=[info.name] if name != info.name else [], help=(mod.__doc__ or "").strip().splitlines()[0]
        )
        bp.add_argument("--json", action="store_true", help="print one JSON object (default: indented)")
        mod.add_arguments(bp)
        bp.set_defaults(func=_runner(mod))


def _runner(mod):
    def run(args) -> int:
        out = mod.run(args)
        out.setdefault("env", env_facts())
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
        return 0

    return run
