// Paged attention over a KV cache that kiln writes and reads itself (the OpenVINO extension's
// kiln.PagedAttentionU8 and kiln.PagedAttentionF16): tokens packed as OpenVINO's
// PagedAttentionExtension takes them, the cache in kiln's own layout (u8 codes with a scale and a
// minimum per token and head, or f16), every product and sum in f32.
//
//   q        [T, heads * hd]        the call's queries (rotated, scaled as the graph scales them)
//   k, v     [T, kv_heads * hd]     the call's new keys (rotated) and values
//   cache    [num_blocks, kv_heads, block_size, row bytes] u8, one for keys and one for values (u8 for
//            either format: the CPU plugin hands an operation a u8 input as the memory bound to it).
//            Each (block, kv head) is one segment of SegmentBytes():
//            kU8: the elements are codes in 32-bit words of four (the words AVX-512 VNNI's vpdpbusd
//                 multiplies by four query or weight bytes at once):
//                   keys    [hd / 4][block_size][4]: a word is 4 consecutive dimensions of one key
//                   values  [block_size / 4][hd][4]: a word is one dimension of 4 consecutive keys
//                 then scale [block_size] f32 and minimum [block_size] f32 follow: a value is
//                 code * scale + minimum (asymmetric, per token and head)
//            kF16: IEEE half floats, keys [hd][block_size] (16 keys of one dimension side by side),
//                 values [block_size][hd]
//   past_lens [B], subsequence_begins [B+1], block_indices, block_indices_begins [B+1]: int32, as
//            OpenVINO's operation takes them (sequence b's new tokens are q rows begins[b] ..
//            begins[b+1]; its blocks are block_indices[block_begins[b] ..])
//   out      [T, heads * hd]
//
// The call first stores its new keys and values into their blocks (StoreToken), then every query
// reads all its keys from the cache, the call's own among them: the keys it sees are its sequence's positions 0 .. past + s
// (causal), or the last `window` of them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "paged_attention.h"

namespace kiln {

// kF32: not a cache's format; the widened copy of a span that a task of many queries reads.
enum class KvFormat { kU8, kF16, kF32 };

constexpr int kU8RowExtra = 8;          // a u8 token's bytes after its codes: scale, minimum (f32 each)
constexpr int kKvMaxQueries = 64;       // query vectors one task holds: its tokens times the group's heads
constexpr int kKvTileQueries = 512;     // ... on the amx level's tiles (paged_kv_attention_amx.cc), where
                                        // a task widens its span once for more queries

// A token's bytes for one kv head (a cache row, the last dimension of the cache's shape).
inline int RowBytes(int head_dim, KvFormat f) {
  return f == KvFormat::kU8 ? head_dim + kU8RowExtra : (f == KvFormat::kF16 ? 2 : 4) * head_dim;
}

inline size_t SegmentBytes(int head_dim, int block_size, KvFormat f) {
  return static_cast<size_t>(block_size) * RowBytes(head_dim, f);
}

struct PackedAttention {
  int tokens, heads, kv_heads, head_dim, num_blocks, block_size, sequences;
};

// Where sequence b sits in the packed call.
struct PackedSequence {
  int64_t past;              // tokens already in the cache
  int begin, count;          // its new tokens: q rows begin .. begin + count
  const int32_t* blocks;     // its block ids, in order
  int num_blocks;            // how many of them the call may read
};

// One (block, kv head) segment of a cache; scale and minimum are null for f16.
struct Segment {
  const uint8_t* codes;
  const float* scale;
  const float* minimum;
};

inline Segment SegmentOf(const PackedAttention& s, const uint8_t* cache, int64_t block, int g, KvFormat f) {
  const uint8_t* base = cache + (block * s.kv_heads + g) * SegmentBytes(s.head_dim, s.block_size, f);
  if (f != KvFormat::kU8) return {base, nullptr, nullptr};
  const float* scale = reinterpret_cast<const float*>(base + static_cast<size_t>(s.head_dim) * s.block_size);
  return {base, scale, scale + s.block_size};
}

// Empty when every sequence's blocks cover past + new tokens and name blocks inside the pool;
// otherwise what is wrong. Counts in int64, so no input can overflow the check.
inline const char* CheckPacked(const PackedAttention& s, const PackedSequence& seq) {
  if (seq.past < 0 || seq.count < 0 || seq.begin < 0 || static_cast<int64_t>(seq.begin) + seq.count > s.tokens)
    return "a sequence's past length or its new tokens lie outside the call";
  const int64_t needed = (seq.past + seq.count + s.block_size - 1) / s.block_size;
  if (needed > seq.num_blocks) return "a sequence has fewer blocks than its past and new tokens need";
  for (int64_t i = 0; i < needed; ++i)
    if (seq.blocks[i] < 0 || seq.blocks[i] >= s.num_blocks) return "a block id is outside the KV pool";
  return nullptr;
}

// Writes one token's hd values into slot `slot` of a segment, in the keys' or the values' layout.
using StoreTokenFn = void (*)(KvFormat f, const float* x, int head_dim, int block_size, uint8_t* segment, int slot,
                              bool keys);

// One task: sequence `seq`, kv head g, its new tokens [s0, s1) — every query head of the group, at
// most the level's query vectors per task (kv_task_queries) — writing out's rows of those tokens and
// heads. k and v are the call's new keys and values, already stored: every query reads keys and
// values as the cache holds them, the call's own tokens too, so a prefill sees what the decodes after
// it will (OpenVINO's operation does the same: kiln's and its greedy answers agree token for token).
using AttendKvFn = void (*)(KvFormat f, const PackedAttention& s, const AttentionParams& p, const float* q,
                            const float* k, const float* v, const uint8_t* key_cache, const uint8_t* value_cache,
                            const PackedSequence& seq, int g, int s0, int s1, float* out);

// The query vectors one task may hold for a head width (the op's tasks; null: kKvMaxQueries).
using KvTaskQueriesFn = int (*)(int head_dim);

// A u8 cache's decode (sequence `seq` has one new token, already stored) for kv heads [g0, g1) in one
// pass over its blocks: a block's keys of consecutive heads are one run of the cache, read in order.
using KvDecodeFn = void (*)(const PackedAttention& s, const AttentionParams& p, const float* q,
                            const uint8_t* key_cache, const uint8_t* value_cache, const PackedSequence& seq, int g0,
                            int g1, float* out);

#define KILN_KV_ATTENTION_COPY(Level)                                                                        \
  void StoreToken##Level(KvFormat, const float*, int, int, uint8_t*, int, bool);                            \
  void AttendKv##Level(KvFormat, const PackedAttention&, const AttentionParams&, const float*, const float*,     \
                       const float*, const uint8_t*, const uint8_t*, const PackedSequence&, int, int, int, float*);
KILN_KV_ATTENTION_COPY(Scalar)
KILN_KV_ATTENTION_COPY(Avx2)
KILN_KV_ATTENTION_COPY(Avx512)
#undef KILN_KV_ATTENTION_COPY

}  // namespace kiln
