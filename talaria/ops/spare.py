"""A warm spare: a service's process started ahead of need, its imports done, waiting
to be told to run.

A supervised service that dies (or is killed as hung) is back only when its
replacement has started Python and imported its stack (nats-py, redis-py, aiohttp,
msgspec, the service itself): about 0.45 s of CPU on a 2-core machine, over a
second when the machine is busy, which is most of a restart. The supervisor
(`talaria/ops/processes.py`, `ProcessGroup(spares=True)`) keeps one spare per
service, started by

    python -m talaria.ops.spare <module> [args...]

which imports `<module>.__main__` without running it and blocks on stdin. When the
service must be replaced, the supervisor writes one JSON line to the spare's stdin,
`{"env": {...}}` (the environment the service is to run with, decided then: its
metrics port, for one), and the spare runs `<module>` as `python -m <module> args`
would. End of input without that line (the supervisor stopped) ends the spare.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import runpy
import sys


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m talaria.ops.spare <module> [args...]", file=sys.stderr)
        return 2
    module, args = argv[0], argv[1:]
    # import what the service imports: a package's __main__ (which guards its own run
    # with __name__), or the module itself
    spec = importlib.util.find_spec(module)
    if spec is None:
        print(f"spare: no module named {module!r}", file=sys.stderr)
        return 2
    importlib.import_module(f"{module}.__main__" if spec.submodule_search_locations is not None else module)
    line = sys.stdin.readline()
    if not line:
        return 0  # the supervisor stopped before it needed this spare
    order = json.loads(line)
    os.environ.clear()
    os.environ.update(order["env"])
    sys.argv = [module, *args]
    sys.modules.pop(f"{module}.__main__", None)  # run afresh as __main__ (what it imported stays loaded)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
