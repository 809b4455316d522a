"""A real S3-compatible server for tests: moto's server mode in a subprocess on a free loopback port.

pyarrow's S3 filesystem and boto3 reach it through the standard AWS variables (:meth:`S3Server.env`:
``AWS_ENDPOINT_URL`` and dummy credentials), as an operator's deployment reaches a real object store.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """A moto server process the test session owns."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The environment an S3 client needs to use this server (set it with monkeypatch.setenv)."""
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def start(self, timeout_s: float = 30.0) -> S3Server:
        log = open(self.dir / "moto.log", "wb")  # noqa: SIM115 - the process's lifetime
        # cwd away from the checkout, whose top-level folders would shadow installed packages
        args = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    output = (self.dir / "moto.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"moto server did not start on port {self.port}:\n{output}") from None
                time.sleep(0.1)

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name``; its URI ``s3://<name>``."""
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        client.create_bucket(Bucket=name)
        return f"s3://{name}"

    def object_keys(self, bucket: str) -> list[str]:
        """Every object key in ``bucket`` (what a reader of the bucket would see)."""
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
