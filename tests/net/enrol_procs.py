"""Real processes for the enrolment tests: ``kvasir enrol`` (over the bus, and HTTP(S) with a
trustme certificate), ``kvasir market``, ``kvasir status``, each with only the identity its
command line names."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    env.update(extra)
    return env


def kvasir(*argv, timeout=120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvasir_bus.cli", *map(str, argv)], capture_output=True,
                          text=True, env=kw.pop("env", None) or clean_env(), timeout=timeout, **kw)


class Proc:
    """A ``kvasir`` child whose output goes to ``log``; ``ready(pattern)`` reads its output up to
    the first line matching ``pattern`` (a blocking read of the pipe, no polling) and returns
    the match; the rest is copied to the log by a thread."""

    def __init__(self, log: Path, *argv, env=None):
        self.log = Path(log)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvasir_bus.cli", *map(str, argv)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env or clean_env())
        self._out = open(self.log, "w")
        self._copier: threading.Thread | None = None

    def ready(self, pattern: str) -> re.Match:
        rx = re.compile(pattern)
        for line in self.proc.stdout:
            self._out.write(line)
            self._out.flush()
            found = rx.search(line)
            if found:
                self._copier = threading.Thread(target=self._copy, daemon=True)
                self._copier.start()
                return found
        raise AssertionError(f"the process ended ({self.proc.wait()}) before printing {pattern!r}: "
                             f"{self.log.read_text()[-2000:]}")

    def _copy(self) -> None:
        for line in self.proc.stdout:
            self._out.write(line)
            self._out.flush()

    def text(self) -> str:
        return self.log.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._copier is not None:
            self._copier.join(10)
        self._out.close()
        return self.proc.returncode


def enrol_service(dep, url, log, *extra, http=False, tls=None) -> tuple[Proc, str | None]:
    """``kvasir enrol DEP --nats URL`` (with ``--http 127.0.0.1:0`` and the cert/key pair
    ``tls``); returns it with its HTTP(S) enrolment URL once it serves (None without --http)."""
    argv = ["enrol", dep, "--nats", url, *extra]
    if http:
        argv += ["--http", "127.0.0.1:0"]
        if tls is not None:
            argv += ["--tls-cert", tls[0], "--tls-key", tls[1]]
    p = Proc(log, *argv)
    if http:
        return p, p.ready(r"enrolment over https?: (\S+)").group(1)
    p.ready(r"enrol_started")
    return p, None


def market(dep, url, db, log, *models, extra=()) -> Proc:
    p = Proc(log, "market", "--nats", url, "--creds", Path(dep) / "market.creds", "--db", db,
             *(a for m in models for a in ("--model", m)), "--expiry", "5", "--demand-interval", "0.5", *extra)
    p.ready(r"market_started")
    return p


def tls_files(tmp_path) -> tuple[tuple[str, str], str]:
    """A server certificate for 127.0.0.1 from a fresh trustme CA: ((cert, key), CA file)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    chain, key, ca_file = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key))
    chain.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    ca.cert_pem.write_to_path(str(ca_file))
    return (str(chain), str(key)), str(ca_file)
