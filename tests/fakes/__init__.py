"""Offline stand-ins for the clouds: moto's EC2 behind a fault middleware, and a fake Compute REST server."""


class ServedInThread:
    """start()/stop() for a fake whose ``server`` (a socketserver) runs ``serve_forever`` in ``thread``."""

    server: object
    thread: object

    def start(self):
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
