"""What the tests of kiln's native libraries share: the ONNX Runtime op library, built once (a
machine with no C++ compiler skips them; one with a compiler must build it)."""

from __future__ import annotations

import pytest

from kiln.engines.ort.native.build import build


@pytest.fixture(scope="module")
def library():
    path, message = build()
    if path is None and "no C++ compiler" in message:
        pytest.skip(message)
    assert path is not None, message       # a compiler is here: the library must build
    return path
