"""Joining a durastack deployment: the Temporal connection (address, TLS, API key), the payload codec that
encrypts secrets, and the files in the home every process of one deployment shares (the codec key, the
installation id). The worker, the CLI, the server supervisor, tests and benchmarks connect through here.
"""
