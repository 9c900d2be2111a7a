"""The Serve application: the ingress deployment in front of the replica deployment.

`build_app(args)` is the application builder `serve run` and Serve config files name
(deploy/ray/kiln.yaml); `run(...)` is `kiln serve ARTIFACT --replicas N`: it starts a local Ray
cluster (or joins --ray-address), runs the application and blocks until SIGINT/SIGTERM.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from kiln.config import RuntimeConfig, ServeConfig
from kiln.runtime.memory import default_kv_budget
from kiln.scale.ingress import HedgeOptions, Ingress, create_ingress_app
from kiln.scale.replica import KilnReplica
from kiln.scale.router import ROUTING_STATS_PERIOD_S
from kiln.units import parse_bytes

APP_NAME = "kiln"


@dataclass(frozen=True)
class ScaleOptions:
    replicas: int = 2
    replica_cpus: float = 1.0          # Ray logical CPUs per replica (and its engine threads, if unset)
    max_replicas: int | None = None    # above `replicas`: autoscale between the two on kiln's signals
    max_ongoing_requests: int = 64     # per replica; past it Serve queues at the ingress
    drain_timeout: float = 30.0        # seconds a replica being removed waits for its streams
    hedge: bool = False
    hedge_fraction: float = 0.05
    hedge_floor: float = 0.5
    upscale_delay: float = 10.0
    downscale_delay: float = 60.0
    imbalance_abs: float = 4.0
    imbalance_rel: float = 1.5
    prefix_routing: bool = True        # False: Serve's default router (the benchmark's baseline)
    slow_replica_delay: float = 0.0    # test/benchmark knob: the rank-0 replica's streams start this late
    slow_replica_every: int = 1        # ... every n-th of them
    slow_replica_rank: int | None = 0  # ... on the replica of this rank (None: on every replica)
    replica_header: bool = False       # test/benchmark knob: name the answering replica in x-kiln-replica

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below replicas ({self.replicas})")
        if self.replica_cpus <= 0 or self.drain_timeout <= 0:
            raise ValueError("replica_cpus and drain_timeout must be positive")


# NOTE: Serve's default max_ongoing_requests (5) would queue every sixth client at the proxy
# (with 16 clients TTFT grew many times over: docs/results/2026-12-06-figures-from-code-comments.md);
# the ingress only relays streams, so it takes many.
@serve.deployment(name="kiln-ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress()
class KilnIngress:
    def __init__(self, replicas, artifact: str, config: ServeConfig, model_name: str,
                 hedge: HedgeOptions | None = None, replica_header: bool = False):
        self.ingress = Ingress(replicas, artifact, config, model_name, hedge, replica_header)

    def __serve_build_asgi_app__(self):
        return create_ingress_app(self.ingress)


def replica_deployment(options: ScaleOptions):
    autoscaling = None
    if options.max_replicas is not None and options.max_replicas > options.replicas:
        autoscaling = AutoscalingConfig(
            min_replicas=options.replicas, max_replicas=options.max_replicas, initial_replicas=options.replicas,
            upscale_delay_s=options.upscale_delay, downscale_delay_s=options.downscale_delay,
            metrics_interval_s=2.0, look_back_period_s=10.0,
            policy={"policy_function": "kiln.scale.autoscale:kiln_autoscaling_policy"})
    router = RequestRouterConfig(
        request_router_class="kiln.scale.router:KilnPrefixRouter",
        request_router_kwargs={"abs_threshold": options.imbalance_abs, "rel_threshold": options.imbalance_rel},
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    routing = {"request_router_config": router} if options.prefix_routing else {}
    return serve.deployment(KilnReplica, name="kiln-replica").options(
        num_replicas=None if autoscaling else options.replicas, autoscaling_config=autoscaling,
        ray_actor_options={"num_cpus": options.replica_cpus},
        max_ongoing_requests=options.max_ongoing_requests, **routing,
        graceful_shutdown_timeout_s=options.drain_timeout, graceful_shutdown_wait_loop_s=1.0,
        health_check_period_s=5.0)


def application(artifact: str | Path, runtime: RuntimeConfig, config: ServeConfig, options: ScaleOptions,
                model_name: str | None = None):
    artifact = str(Path(artifact).resolve())
    name = model_name or config.served_model_name or Path(artifact).name
    if runtime.threads is None:              # replicas share the machine: one thread per CPU share
        runtime = _with(runtime, threads=max(1, int(options.replica_cpus)))
    replicas = replica_deployment(options).bind(artifact, runtime, config, name, options.slow_replica_delay,
                                                options.slow_replica_every, options.slow_replica_rank)
    hedge = HedgeOptions(options.hedge_fraction, options.hedge_floor) if options.hedge else None
    return KilnIngress.bind(replicas, artifact, config, name, hedge, options.replica_header)


def build_app(args: dict):
    """The builder for `serve run kiln.scale.app:build_app artifact=PATH replicas=2` and for
    Serve config files: `artifact` is required; the others are ScaleOptions and ServeConfig
    fields (served_model_name, api_key, ...) by name, a nested config as a mapping of its own
    fields (admission: {ttft_slo: 2.0}), `threads`, and `kv_cache_memory` (each replica's KV pool;
    by default a quarter of what its node's memory, container limit included, leaves)."""
    args = dict(args)
    if "artifact" not in args:
        raise ValueError("build_app needs artifact=PATH (an engine artifact folder)")
    artifact = args.pop("artifact")
    scale = {f.name: _coerce(args.pop(f.name), f.type) for f in fields(ScaleOptions) if f.name in args}
    threads = args.pop("threads", None)
    kv_cache_memory = args.pop("kv_cache_memory", None)     # each replica's, e.g. "4GiB"
    config = _config(ServeConfig, args, "build_app")
    runtime = RuntimeConfig(threads=int(threads) if threads is not None else None,
                            kv_cache_memory=parse_bytes(kv_cache_memory) if kv_cache_memory is not None else None)
    return application(artifact, runtime, config, ScaleOptions(**scale))


def run(artifact: Path, runtime: RuntimeConfig, config: ServeConfig, options: ScaleOptions,
        ray_address: str | None = None, announce=print, ray_node_ip: str | None = None) -> None:
    """Start (or join) Ray, run the application on config.host:config.port, block until a signal.
    ray_node_ip: the address a local cluster's own services listen on (default: loopback only)."""
    import ray

    if ray_address:
        ray.init(address=ray_address)
    else:
        start_local_ray(max(options.replica_cpus * most_replicas(options) + 1, 2), ray_node_ip)
        runtime = shared_kv_budget(runtime, options)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(application(artifact, runtime, config, options), name=APP_NAME, route_prefix="/")
        announce(f"serving on Ray Serve: http://{config.host}:{config.port}/v1 with {options.replicas} "
                 f"replica(s){' (autoscaling to ' + str(options.max_replicas) + ')' if options.max_replicas else ''}")
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


def most_replicas(options: ScaleOptions) -> int:
    return options.max_replicas or options.replicas


def shared_kv_budget(runtime: RuntimeConfig, options: ScaleOptions) -> RuntimeConfig:
    """Replicas on one machine share one KV budget: the default (a fraction of what this process may
    still take, container limit included) split over the most replicas autoscaling may run. Each
    replica taking the fraction for itself would promise the machine's memory N times over. A
    --kv-cache-memory the user gave is each replica's, as given."""
    if runtime.kv_cache_memory is not None:
        return runtime
    return _with(runtime, kv_cache_memory=max(default_kv_budget(runtime) // most_replicas(options), 1))


# Ray's switch for its single-machine mode (the default on macOS and Windows): every service it
# starts takes the loopback address as the node's and listens there.
RAY_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def start_local_ray(cpus: float, node_ip: str | None = None) -> None:
    """A Ray cluster on this machine for kiln's replicas. Its own ports (GCS, raylets, workers,
    object manager, agents) listen on loopback unless node_ip names the address other machines
    reach it on; the dashboard is off. Only the Serve HTTP entry point listens where --host says."""
    import ray

    if node_ip is None:
        # NOTE: set for the processes Ray starts, and for this one, which read it when ray was imported
        from ray._private import ray_constants

        os.environ[RAY_SINGLE_MACHINE_ENV] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(num_cpus=cpus, include_dashboard=False, _node_ip_address=node_ip)


def _with(runtime: RuntimeConfig, **changes) -> RuntimeConfig:
    from dataclasses import replace

    return replace(runtime, **changes)


def _config(cls, args: dict, where: str):
    """A config dataclass from a config file's fields by name; a nested config (ServeConfig's
    admission, response_cache, semantic_cache) from a mapping of its own fields."""
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(f"{where} does not know {', '.join(unknown)}")
    return cls(**{k: _config(known[k].default_factory, v, f"{where}'s {k}") if _nested(known[k])
                  else _coerce(v, known[k].type) for k, v in args.items()})


def _nested(f) -> bool:
    return f.default_factory is not MISSING and is_dataclass(f.default_factory)


def _coerce(value, annotation: str):
    """Config files give strings or YAML scalars; the dataclasses want their own types."""
    kind = str(annotation)
    if value is None or isinstance(value, bool):
        return value
    if kind.startswith("bool"):
        return str(value).lower() in ("1", "true", "yes", "on")
    if kind.startswith("int"):
        return int(value)
    if kind.startswith("float"):
        return float(value)
    if kind.startswith("tuple") and isinstance(value, (list, tuple)):
        return tuple(value)
    return value
