"""`kiln serve`: load the artifact, then run the app under uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
from pathlib import Path

from kiln.config import RuntimeConfig, ServeConfig


def configure_logging(config: ServeConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # NOTE: kiln's records reach the root handler whatever the root's level; libraries stay at info.
    logging.getLogger("kiln").setLevel(config.log_level.upper())


def run_server(artifact: Path, runtime: RuntimeConfig, config: ServeConfig, announce=print) -> None:
    import uvicorn

    from kiln.runtime.llm import LLM
    from kiln.serving.app import create_app

    configure_logging(config)
    llm = LLM(artifact, runtime)         # logs the KV plan it sized
    model_name = config.served_model_name or Path(artifact).resolve().name
    app = create_app(llm, config, model_name)
    base = f"http://{config.host}:{config.port}"
    console = f"; console at {base}/" if config.console else ""
    announce(f"serving '{model_name}' on {base}/v1{console} (ready once /ready says so)")
    # Access logs off: one line per request costs the engine's thread GIL time under load.
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=5)
