"""``python -m gateway --runtime-dir DIR [--port N] [--control-port N]``: the gateway as its own process."""

import argparse
import asyncio
import logging
import os

import prometheus_client

from gateway.app import run_gateway

parser = argparse.ArgumentParser(prog="python -m gateway", description="durastack gateway (nginx + control app)")
parser.add_argument("--runtime-dir", required=True, help="config, logs, state.json and endpoints.json go here")
parser.add_argument("--port", type=int, default=0, help="nginx port (0: pick one)")
parser.add_argument("--control-port", type=int, default=0, help="control app port (0: pick one)")
parser.add_argument("--host", default=os.environ.get("DURASTACK_BIND_HOST") or "127.0.0.1",
                    help="address nginx and the control app listen on (DURASTACK_BIND_HOST; default 127.0.0.1); "
                         "off loopback, DURASTACK_GATEWAY_CONTROL_TOKEN must be set")
parser.add_argument("--netns", action="store_true",
                    help="run nginx in this home's gateway namespace, linked to the local backend's service networks "
                         "(root; `durastack server` sets it when service networks are on)")
args = parser.parse_args()
prometheus_client.disable_created_metrics()  # no *_created series next to every counter and histogram
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
try:
    asyncio.run(run_gateway(args.runtime_dir, args.port, args.control_port, host=args.host,
                            control_token=os.environ.get("DURASTACK_GATEWAY_CONTROL_TOKEN") or None,
                            netns=args.netns))
except ValueError as e:
    parser.exit(2, f"python -m gateway: {e}\n")
