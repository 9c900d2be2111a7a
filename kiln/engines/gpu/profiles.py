"""TensorRT optimization profiles per bucket range, planned from the artifact's bucket grid.

A profile gives every dynamic dimension a (min, opt, max); TensorRT tunes kernels for opt and
sizes activations for max. One profile for the whole grid would tune decode kernels for 512-token
prefills, so the grid is cut into ranges:

    decode   seq 1..8 (drafts included), one profile per batch range  [1..4] [6..24] [28..64]
    prefill  seq ranges 16..128, 160..512; batch up to max_tokens // seq_hi (activation memory)
    every profile: num_blocks up to the pool the build's --kv-cache-memory holds (the engine binds
    the whole pool every call, so that is also the shape to tune for), and logits for at most
    MAX_LOGITS_POSITIONS positions per sequence (serving reads one, or the drafts)

A call whose batch is larger than every profile covering its length is split by rows, and one that
reads more logits positions runs once per slice of them (the engine does both); a length beyond
the grid never reaches the engine (BucketGrid refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.contract.engine import BucketGrid

DECODE_MAX_SEQ = 8          # new tokens per sequence still planned as decode (speculative drafts)
MAX_LOGITS_POSITIONS = DECODE_MAX_SEQ   # logits rows per sequence a call reads: the last token, or the drafts
RANGE_RATIO = 4             # a decode batch range spans at most this factor (hi <= 4 lo)
PREFILL_RATIO = 8           # a prefill length range spans at most this factor
MAX_TOKENS = 8192           # batch x seq cap of a prefill profile's max shape
MAX_VOLUME = 2**31 - 1      # elements of one tensor: many TensorRT layers index with int32

Range = tuple[int, int, int]           # (min, opt, max)


@dataclass(frozen=True)
class Profile:
    name: str
    dims: dict[str, Range]               # dim param of the graph's IO -> (min, opt, max)

    def covers(self, sizes: dict[str, int]) -> bool:
        return all(lo <= sizes[d] <= hi for d, (lo, _, hi) in self.dims.items() if d in sizes)

    @property
    def is_decode(self) -> bool:
        """A decode profile (plan_profiles names them so): its calls get CUDA graphs."""
        return self.name.startswith("decode-")

    def input_shapes(self, io: dict[str, list]) -> dict[str, tuple[list[int], list[int], list[int]]]:
        """name -> (min, opt, max) shapes of every dynamic input; io: dims as ints or param names."""
        return {name: tuple([self._size(d, k) for d in dims] for k in range(3))
                for name, dims in io.items() if any(isinstance(d, str) for d in dims)}

    def _size(self, dim, k: int) -> int:
        if isinstance(dim, int):
            return dim
        if dim not in self.dims:
            raise ValueError(f"profile {self.name!r} has no range for dimension {dim!r}")
        return self.dims[dim][k]

    def to_dict(self) -> dict:
        return {"name": self.name, "dims": {d: list(r) for d, r in self.dims.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        return cls(d["name"], {k: tuple(v) for k, v in d["dims"].items()})


def plan_profiles(grid: BucketGrid, block_size: int, max_model_len: int, pool_blocks: int,
                  max_tokens: int = MAX_TOKENS) -> list[Profile]:
    """Decode profiles per batch range, then prefill profiles per length range, for a KV pool of
    pool_blocks blocks."""
    max_blocks = -(-max_model_len // block_size)
    shared = {"max_blocks": (1, min(max_blocks, -(-1024 // block_size)), max_blocks),
              "num_blocks": (1, pool_blocks, pool_blocks),
              "logits_positions": (1, 1, MAX_LOGITS_POSITIONS)}
    decode_seqs = [s for s in grid.seq_lens if s <= DECODE_MAX_SEQ] or [grid.seq_lens[0]]
    profiles = []
    for batches in split_ranges(grid.batch_sizes, RANGE_RATIO):
        profiles.append(Profile(f"decode-b{batches[0]}-{batches[-1]}", {
            "batch": (batches[0], _middle(batches), batches[-1]), "seq": (1, 1, decode_seqs[-1]), **shared}))
    prefill = [s for s in grid.seq_lens if s > decode_seqs[-1]]
    lo = decode_seqs[-1] + 1
    for seqs in split_ranges(prefill, PREFILL_RATIO):
        batch_max = max([b for b in grid.batch_sizes if b * seqs[-1] <= max_tokens] or [1])
        profiles.append(Profile(f"prefill-s{lo}-{seqs[-1]}", {
            "batch": (1, 1, batch_max), "seq": (lo, _middle(seqs), seqs[-1]), **shared}))
        lo = seqs[-1] + 1
    return profiles


def max_pool_blocks(block_elements: int) -> int:
    """The most blocks one layer's cache may hold: block_elements values a block (kv_heads x
    block_size x head_dim), and the whole cache under MAX_VOLUME elements."""
    return MAX_VOLUME // block_elements


def logits_positions(profiles: list[Profile]) -> int:
    """The most logits positions per sequence every profile takes: a call reading more is sliced."""
    return min(p.dims["logits_positions"][2] for p in profiles)


def split_ranges(sizes: tuple[int, ...] | list[int], ratio: int) -> list[list[int]]:
    """Ascending sizes cut into runs whose largest is at most ratio x their smallest."""
    runs: list[list[int]] = []
    for s in sizes:
        if runs and s <= ratio * runs[-1][0]:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def _middle(run: list[int]) -> int:
    return run[len(run) // 2]


def select_profile(profiles: list[Profile], sizes: dict[str, int]) -> tuple[int, int]:
    """(profile index, rows per call) for a call of these dim sizes.

    The profile is the one covering every size but the batch with the largest batch max (fewest
    row splits), ties to the tightest; rows per call is min(batch, that max)."""
    fits = [i for i, p in enumerate(profiles) if p.covers({**sizes, "batch": p.dims["batch"][0]})]
    if not fits:
        raise ValueError(f"no optimization profile covers {sizes}; rebuild the engine with a grid that does")
    covering = [i for i in fits if profiles[i].covers(sizes)]
    if covering:
        best = min(covering, key=lambda i: profiles[i].dims["batch"][2])
        return best, sizes["batch"]
    best = max(fits, key=lambda i: profiles[i].dims["batch"][2])
    return best, profiles[best].dims["batch"][2]
