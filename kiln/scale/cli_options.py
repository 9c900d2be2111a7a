"""`kiln serve`'s scale-out options (docs/deployment.md); Ray is imported only when they are used."""

from __future__ import annotations

import click

SCALE_OPTIONS = ("replicas", "ray_address", "ray_node_ip", "replica_cpus", "max_replicas", "drain_timeout",
                 "hedge")


def scale_options(fn):
    options = [
        click.option("--replicas", type=int, default=None,
                     help="Serve on Ray Serve with N engine replicas behind a prefix-aware router "
                          "(starts a local Ray cluster unless --ray-address)."),
        click.option("--ray-address", default=None,
                     help="Join this Ray cluster (e.g. ray://head:10001 or auto) instead of starting one."),
        click.option("--ray-node-ip", default=None,
                     help="The address the local Ray cluster's own services listen on, for other machines "
                          "to join it (default: loopback only; the HTTP entry point follows --host)."),
        click.option("--replica-cpus", type=float, default=None,
                     help="Ray CPUs per replica, also its engine threads unless --threads (default 1)."),
        click.option("--max-replicas", type=int, default=None,
                     help="Autoscale between --replicas and N on kiln's admission signals."),
        click.option("--drain-timeout", type=float, default=None,
                     help="Seconds the streams in flight get to finish on shutdown (default 5), or on a Ray "
                          "replica's removal (default 30)."),
        click.option("--hedge", is_flag=True, default=False,
                     help="Hedge requests: a duplicate to another replica after the recent p95 TTFT without "
                          "a first token (at most 5% of requests)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def wants_ray(scale: dict) -> bool:
    return scale.get("replicas") is not None or scale.get("ray_address") is not None \
        or scale.get("max_replicas") is not None


def run_on_ray(artifact, runtime, config, scale: dict, announce) -> None:
    from kiln.scale.app import ScaleOptions, run

    cluster = ("ray_address", "ray_node_ip", "hedge")
    given = {k: v for k, v in scale.items() if k not in cluster and v is not None}
    given.setdefault("replicas", 1)
    options = ScaleOptions(**given, hedge=bool(scale.get("hedge")))
    run(artifact, runtime, config, options, ray_address=scale.get("ray_address"), announce=announce,
        ray_node_ip=scale.get("ray_node_ip"))
