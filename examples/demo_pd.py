"""`make demo-pd`: PD disaggregation on this machine, behind SGLang's real model gateway.

Starts `durastack server` in a temporary home, validates the seed's GPU service, applies the runnable stand-in
(examples/pd-disaggregation/standin.yml: `smg` as the router group, started with no workers; stand-in SGLang
engines as the prefill and decode groups), and, under 8 requests/s through the gateway, shows decode scaled
1 → 3 with all three serving, a rolling update of each group, decode scaled back and a kill -9 of each worker:
after each, the failed requests, the router's restarts and the router's worker list (bench/pd.py measures the
same). Then it stops everything.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pd import EXAMPLE, NAME, run, setup_env  # noqa: E402
from bench.stack import BenchStack, step  # noqa: E402


def main() -> None:
    setup_env()  # the stand-in's `env: [PD_EXAMPLE, SMG]`
    with BenchStack(log=lambda line: print(line, flush=True)) as stack:
        print(f"Web UI: {stack.settings.ui_url}   gateway: {stack.gateway}")
        step("durastack validate -f examples/pd-disaggregation/service.yml  (the seed's GPU service)")
        print(stack.check("validate", "-f", str(EXAMPLE / "service.yml")))
        run(stack, 8.0)
        step(f"durastack ps {NAME} -v  (the router's worker list at the end)")
        print(stack.check("ps", NAME, "-v"))
        step(f"durastack events {NAME}")
        print(stack.check("events", NAME))
        step(f"durastack stop {NAME}")
        print(stack.check("stop", NAME, "-y"))
    print("\nDone: the service, the replicas and the server are stopped.")


if __name__ == "__main__":
    main()
