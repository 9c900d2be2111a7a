"""`kiln build` from a GGUF needs no torch (the `build` extra has none): kiln reads the tokenizer's
metadata itself and hands it to transformers' torch-free converter. What it builds must equal what
transformers' own GGUF path (`from_pretrained(gguf_file=...)`, which imports torch) builds."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from gguf_writing import write_gguf
from kiln.compiler.export.gguf_reader import GGUFFile
from kiln.compiler.export.gguf_tokenizer import save_tokenizer
from kiln.compiler.export.presets import smollm2_gguf_path

BLOCK_TORCH = "import sys; sys.modules['torch'] = None   # any `import torch` now raises ImportError\n"


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_a_gguf_source_loads_where_torch_cannot_be_imported(tmp_path, arch):
    written = write_gguf(arch, tmp_path)
    script = BLOCK_TORCH + textwrap.dedent(f"""
        from kiln.compiler.export.sources import load_source
        from kiln.tokenizer import Tokenizer
        src = load_source({str(written.path)!r})
        print(Tokenizer(src.tokenizer_dir).eos_token_id)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.split()[-1]) == written.tokenizer["eos"]


def test_smollm2_tokenizer_equals_transformers_own_gguf_path(tmp_path):
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    save_tokenizer(GGUFFile(path), "llama", tmp_path / "kiln")
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(tmp_path / "hf"))
    ours, theirs = (json.loads((tmp_path / side / "tokenizer.json").read_text()) for side in ("kiln", "hf"))
    assert ours == theirs
    ours, theirs = (json.loads((tmp_path / side / "tokenizer_config.json").read_text()) for side in ("kiln", "hf"))
    for config in (ours, theirs):
        config.pop("tokenizer_class")            # kiln writes the portable name (see _portable_class)
    for loading_only in ("is_local", "local_files_only"):     # from_pretrained's own bookkeeping
        theirs.pop(loading_only, None)
    assert ours == theirs
    assert (tmp_path / "kiln" / "chat_template.jinja").read_text() == (tmp_path / "hf" / "chat_template.jinja").read_text()
