"""How kiln's processes log: one format, kiln's own loggers at the level the operator chose."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    # NOTE: kiln's records reach the root handler whatever the root's level; libraries stay at info.
    logging.getLogger("kiln").setLevel(level.upper())
