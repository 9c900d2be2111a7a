"""Load an artifact's engine: the manifest's backend field picks the loader (kiln.contract.backends).

Every consumer (engine core, evaluator, server, Triton) loads engines through load_engine and
never names a concrete engine class. Loaders import lazily, so an artifact for one backend never
loads another's library.
"""

from __future__ import annotations

from kiln.contract.artifact import ArtifactError, EngineArtifact
from kiln.contract.backends import BACKENDS
from kiln.contract.engine import Engine


def load_engine(artifact: EngineArtifact, threads: int | None = None) -> Engine:
    record = artifact.manifest.engines[0]
    backend = BACKENDS.get(record["backend"])
    if backend is None:
        raise ArtifactError(f"{artifact.path} needs the {record['backend']!r} engine backend, which this "
                            f"kiln does not have (it has {', '.join(sorted(BACKENDS))}); rebuild it with "
                            "`kiln build --backend auto` or upgrade kiln")
    return backend.load_function()(artifact, record, threads)
