"""`make demo`: the whole product on this machine in one run.

Starts `durastack server` (Temporal dev server, worker, nginx gateway) in a temporary home with
free ports, applies the seed's replica-groups service, shows `ps`, sends requests through the
gateway with the token, reads each replica's /tmp/version.txt, rolls out a new version under
traffic, then stops everything. Nothing is left running.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.stack import BenchStack, step  # noqa: E402

FIXED = ROOT / "examples" / "replica-groups-fixed.yml"
NAME = "replica-groups-fixed"


def main() -> None:
    with BenchStack(log=lambda line: print(line, flush=True)) as stack:
        print(f"Web UI: {stack.settings.ui_url}   gateway: {stack.gateway}")
        step(f"durastack validate -f {FIXED.relative_to(ROOT)}")
        print(stack.check("validate", "-f", str(FIXED)))
        step(f"durastack apply -f {FIXED.relative_to(ROOT)} -y")
        print(stack.check("apply", "-f", str(FIXED), "-y"))
        step("durastack ps")
        print(stack.check("ps"))
        step("durastack token add demo  (printed once: the gateway keeps only its hash)")
        token = stack.check("token", "add", "demo").strip()
        print(token)
        print(stack.check("token", "list"))
        url = f"{stack.gateway}/services/{NAME}/"
        step(f"10 requests through {url}")
        statuses = [httpx.get(url, headers={"Authorization": f"Bearer {token}"}).status_code for _ in range(10)]
        print("statuses:", statuses, "| without the token:", httpx.get(url).status_code)
        step("each replica's /tmp/version.txt (durastack exec NAME --replica N -- cat /tmp/version.txt)")
        for replica in (0, 1, 2):
            print(f"replica {replica}:", stack.check("exec", NAME, "--replica", str(replica), "--",
                                                      "cat", "/tmp/version.txt").strip())
        step("rolling deployment: Version 1")
        v1 = Path(stack.tmp) / "v1.yml"
        v1.write_text(FIXED.read_text().replace("Version 0", "Version 1"))
        print(stack.check("apply", "-f", str(v1), "-y"))
        print(stack.check("ps", "-v"))
        step("durastack events")
        print(stack.check("events", NAME))
        step(f"durastack stop {NAME}")
        print(stack.check("stop", NAME, "-y"))
    print("\nDone: the service, the replicas and the server are stopped.")


if __name__ == "__main__":
    main()
