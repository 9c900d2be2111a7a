"""kiln's serving app on the tiny model in the test's own process (starlette's TestClient), for tests
that need the server's internals at hand; imported by name, as serving_flags is."""

from __future__ import annotations

from starlette.testclient import TestClient
from waiting import wait_until

from kiln import LLM, RuntimeConfig
from kiln.config import AdmissionConfig, ServeConfig
from kiln.serving.http import app as app_module

MODEL = "tiny"
LOOPBACK = "http://127.0.0.1"


def app_client(artifact, **config) -> tuple[TestClient, LLM]:
    """A client of the app over `artifact` (not yet started) and its LLM. ttft_slo 0: admission never
    refuses, however loaded the test machine is."""
    llm = LLM(artifact, RuntimeConfig(kv_cache_memory=16 << 20, threads=1))
    app = app_module.create_app(llm, ServeConfig(**{"admission": AdmissionConfig(ttft_slo=0), **config}), MODEL)
    return TestClient(app, base_url=LOOPBACK), llm


def wait_ready(client: TestClient, timeout: float = 60.0) -> None:
    wait_until(lambda: client.get("/ready").status_code == 200, timeout=timeout, interval=0.02)
