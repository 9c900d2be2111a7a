"""The `kiln` command line: parse, call, print. No logic lives here."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import click
from rich.console import Console

console = Console(stderr=True)


@click.group()
@click.version_option(package_name="kiln")
def main():
    """kiln: build LLM engines and serve them."""


@main.command()
@click.argument("model")
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path), help="Artifact folder to create.")
@click.option("--quant", type=click.Choice(["none", "int8", "int4"]), default="none", show_default=True)
@click.option("--block-size", default=16, show_default=True, help="KV cache block size in tokens.")
@click.option("--no-fuse", is_flag=True, help="Skip the fusion passes.")
@click.option("--no-verify", is_flag=True, help="Skip the numeric check after each pass.")
@click.option("--force", is_flag=True, help="Overwrite an existing artifact folder.")
def build(model, out, quant, block_size, no_fuse, no_verify, force):
    """Build an engine artifact from MODEL: a preset (smollm2-135m, tiny-llama, tiny-qwen2),
    a .gguf file or a Hugging Face checkpoint folder."""
    from kiln.build import BuildConfig
    from kiln.build import build as run_build
    from kiln.passes.quantize import QuantMode

    cfg = BuildConfig(source=model, out=out, quant=QuantMode(quant), block_size=block_size,
                      fuse=not no_fuse, verify=not no_verify, force=force)
    t0 = time.perf_counter()
    path = _guarded(lambda: run_build(cfg, stage=_rich_stage))
    console.print(f"[bold green]built[/] {path} in {time.perf_counter() - t0:.1f} s")


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@click.option("--context", default=2048, show_default=True, help="Context length for the capacity line.")
@click.option("--memory", default="4GiB", show_default=True, help="KV memory budget for the capacity line.")
def inspect(artifact, as_json, context, memory):
    """Show what an artifact holds: model, quantization, buckets, KV layout, passes, files."""
    from kiln.artifact import EngineArtifact
    from kiln.inspect_view import render_manifest
    from kiln.units import parse_bytes

    art = _guarded(lambda: EngineArtifact.load(artifact, verify=False))
    if as_json:
        click.echo(json.dumps(art.manifest.to_json(), indent=1))
        return
    Console().print(render_manifest(art, context_len=context, memory_bytes=parse_bytes(memory)))


@contextmanager
def _rich_stage(name: str):
    t0 = time.perf_counter()
    with console.status(f"{name} …"):
        yield
    console.print(f"  [green]✓[/] {name} [dim]({time.perf_counter() - t0:.1f} s)[/]")


def _guarded(fn):
    """Turn the errors a user can act on into a one-line message and exit code 1."""
    from kiln.artifact import ArtifactError
    from kiln.export.spec import UnsupportedModelError
    from kiln.passes.base import PassCheckError

    try:
        return fn()
    except (ArtifactError, UnsupportedModelError, PassCheckError, FileNotFoundError, ValueError) as e:
        console.print(f"[bold red]error:[/] {e}")
        raise SystemExit(1) from None
