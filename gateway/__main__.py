"""``python -m gateway --runtime-dir DIR [--port N] [--control-port N]``: the gateway as its own process."""

import argparse
import asyncio
import logging

from gateway.app import run_gateway

parser = argparse.ArgumentParser(prog="python -m gateway", description="durastack gateway (nginx + control app)")
parser.add_argument("--runtime-dir", required=True, help="config, logs, state.json and endpoints.json go here")
parser.add_argument("--port", type=int, default=0, help="nginx port on 127.0.0.1 (0: pick one)")
parser.add_argument("--control-port", type=int, default=0, help="control app port on 127.0.0.1 (0: pick one)")
args = parser.parse_args()
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
asyncio.run(run_gateway(args.runtime_dir, args.port, args.control_port))
