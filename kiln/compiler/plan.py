"""The build plan: every choice `kiln build` makes about one model on one machine, as data with its reason.

kiln.compiler.resolve makes it from the build config, the model and the build host (`BuildHost`, read
once at the start of a build); the passes and the backends apply it and decide nothing themselves;
the manifest stores it (`BuildPlan.to_dict`) and `kiln inspect` prints it. The dataclasses here hold
no rules: docs/building.md says what each choice depends on.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, replace

from kiln.contract.cpu import HostCPU, describe, host

# The linears a decoder layer has, and the tables around them, as the quantize recipe names them.
ROLES = ("qkv", "o", "gate_up", "down", "lm_head", "embedding")
# Each layer role's node-name segments, before and after the projections are merged (fuse_projections.py).
ROLE_SEGMENTS = {"qkv": ("qkv_proj", "q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                 "gate_up": ("gate_up_proj", "gate_proj", "up_proj"), "down": ("down_proj",)}


@dataclass(frozen=True)
class Choice:
    value: str
    chosen_by: str          # "auto" | "user"
    reason: str

    def to_dict(self) -> dict:
        return {"value": self.value, "chosen_by": self.chosen_by, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict) -> "Choice":
        return cls(d["value"], d["chosen_by"], d["reason"])


@dataclass(frozen=True)
class Kernel:
    """How one role's weights are stored and multiplied."""
    op: str                  # "fp32" | "MatMulNBits" | "GatherBlockQuantized" | "DynamicQuantizeMatMul" |
    #                          "kiln.MatMulQ8" | "kiln.MatMulQ4Min" | "openvino" | "kiln.LinearI8" | "kiln.GateUpI8"
    bits: int = 32
    block_size: int = 0      # 0: one scale per output channel (or none)
    rounding: str = ""       # 4-bit MatMulNBits: "search" | "min_max" | "block_offsets"
    activations: str = ""    # what the op rounds its input to: "int8" | "int16" | "uint8" | "" (float)
    weight_range: int = 0    # DynamicQuantizeMatMul: the largest weight magnitude (127, or 63 without VNNI)
    weights: str = ""        # "openvino": how the plugin compresses the weights (a WeightCompression value)
    shared: bool = False     # the embedding reads the tied LM head's table


@dataclass(frozen=True)
class RoleKernel:
    role: str                # one of ROLES
    kernel: Kernel
    reason: str


@dataclass(frozen=True)
class QuantRecipe:
    mode: str                            # a QuantMode value
    applied_by: str                      # "kiln" (the quantize pass) | "backend" (it compresses the fp32 graph)
    roles: tuple[RoleKernel, ...] = ()
    compute: str = ""                    # the backend's activation precision where it has a choice ("f32" | "bf16")
    kv_cache: str = ""                   # the KV cache precision that goes with it ("" the build's --kv-dtype)
    note: str = ""                       # what the build prints about its linears ("" nothing to say)
    fp32_layers: tuple[int, ...] = ()    # decoder layers whose linears stay fp32 (the ladder's sensitive rung)

    def role(self, name: str) -> RoleKernel:
        return next(r for r in self.roles if r.role == name)

    def ops(self) -> set[str]:
        return {r.kernel.op for r in self.roles}

    @classmethod
    def from_dict(cls, d: dict) -> "QuantRecipe":
        roles = tuple(RoleKernel(r["role"], Kernel(**r["kernel"]), r["reason"]) for r in d["roles"])
        return cls(**{**d, "roles": roles, "fp32_layers": tuple(d.get("fp32_layers", ()))})


@dataclass(frozen=True)
class Fusion:
    name: str                            # a fusion pass's name
    applies: bool
    without: tuple[str, ...] = ()        # parts of the pass left out (MergeProjections: "mlp")
    reason: str = ""                     # why it is off, or why parts are left out ("" applies whole)


@dataclass(frozen=True)
class BuildHost:
    """What the build machine offers, as the plan's inputs: its CPU and which of kiln's op libraries are built."""
    cpu: HostCPU
    ort_ops: bool = False                # kiln/engines/ort/native's library
    openvino_ops: bool = False           # kiln/engines/openvino/native's library
    openvino: bool = False               # the openvino package is installed

    @classmethod
    def probe(cls) -> "BuildHost":
        """This machine: read at the start of a build, and nowhere else in the compiler."""
        from kiln.engines.openvino import native as ov_native
        from kiln.engines.ort import native as ort_native

        return cls(host(), ort_native.available(), ov_native.available(),
                   importlib.util.find_spec("openvino") is not None)

    def to_dict(self) -> dict:
        return {"machine": self.cpu.machine, "cpu_class": self.cpu.cpu_class,
                "flags": None if self.cpu.flags is None else sorted(self.cpu.flags),
                "ort_ops": self.ort_ops, "openvino_ops": self.openvino_ops, "openvino": self.openvino}

    @classmethod
    def from_dict(cls, d: dict) -> "BuildHost":
        return cls(describe(d["flags"], d["machine"]), d["ort_ops"], d["openvino_ops"], d["openvino"])


@dataclass(frozen=True)
class BuildPlan:
    backend: Choice
    quant: Choice
    attention: Choice                    # the ort core, or what the backend runs instead
    kv_dtype: Choice
    fusions: tuple[Fusion, ...]
    recipe: QuantRecipe
    host: BuildHost
    prefill_recipe: QuantRecipe | None = None    # the ort prefill engine's (--prefill-engine), None without one
    rung: str = "primary"                # which plan of the ladder this is (kiln.compiler.resolve.fallbacks)

    def choices(self) -> dict:
        """The manifest's `choices` entry (backend, quant, attention), as builds before the plan recorded it."""
        out = {"backend": self.backend.to_dict(), "quant": self.quant.to_dict()}
        if self.backend.value in ATTENTION_CHOOSERS:
            out["attention"] = self.attention.to_dict()
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["host"] = self.host.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "BuildPlan":
        prefill = d.get("prefill_recipe")
        return cls(backend=Choice.from_dict(d["backend"]), quant=Choice.from_dict(d["quant"]),
                   attention=Choice.from_dict(d["attention"]), kv_dtype=Choice.from_dict(d["kv_dtype"]),
                   fusions=tuple(Fusion(f["name"], f["applies"], tuple(f["without"]), f["reason"])
                                 for f in d["fusions"]),
                   recipe=QuantRecipe.from_dict(d["recipe"]), host=BuildHost.from_dict(d["host"]),
                   prefill_recipe=None if prefill is None else QuantRecipe.from_dict(prefill), rung=d["rung"])


@dataclass(frozen=True)
class Fallback:
    """A rung of the build's ladder: the plan the build moves to when the one before it fails the
    quantization check. A rung is taken only where it changes nothing the user chose."""
    plan: BuildPlan
    stage: str                           # what the build says as it moves ("{failure}": the check's message)
    reason: str                          # what the backend choice's reason gains, "{failure}" likewise
    changes: tuple[str, ...] = ()        # which of the user's choices it changes: "backend", "quant"
    flags: str = ""                      # the `kiln build` flags that ask for it ("" none do)

    @property
    def name(self) -> str:
        return self.plan.rung

    def allowed_after(self, plan: BuildPlan) -> bool:
        """Whether the build may move here on its own: the user named none of what it changes."""
        chosen = {"backend": plan.backend, "quant": plan.quant}
        return all(chosen[what].chosen_by != "user" for what in self.changes)

    def how_to_ask(self) -> str:
        return f"`{self.flags}`" if self.flags else "`kiln build` without --quant and --backend tries it"

    def taken(self, failure: str) -> BuildPlan:
        backend = self.plan.backend
        why = f"{backend.reason}; {self.reason.format(failure=failure)}"
        return replace(self.plan, backend=Choice(backend.value, backend.chosen_by, why))


# The backends whose attention core depends on the build (ort: --attention; openvino: the model).
ATTENTION_CHOOSERS = ("ort", "openvino")
