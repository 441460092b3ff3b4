"""Offline stand-ins for the clouds: moto's EC2 behind a fault middleware, and a fake Compute REST server."""
