"""Whether an error means the disk (or a file-size limit) stopped a write: the build's failures a
user fixes by freeing space, told apart from every other error."""

from __future__ import annotations

import re


def _short_write(e: OSError) -> bool:
    """numpy's tofile reports a write the disk cut short without an errno: "N requested and M written"."""
    return e.errno is None and re.search(r"\d+ requested and \d+ written", str(e)) is not None


# ENOSPC, EFBIG, EDQUOT: as OSErrors, or inside a library's own error (safetensors, ONNX, OpenVINO
# write through native code and say "(os error 28)").
_SPACE_ERRNOS = (28, 27, 122)


def out_of_space(e: BaseException) -> bool:
    if isinstance(e, OSError) and (e.errno in _SPACE_ERRNOS or _short_write(e)):
        return True
    text = str(e)
    return any(f"os error {n})" in text for n in _SPACE_ERRNOS) or "No space left on device" in text
