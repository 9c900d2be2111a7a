// Attention that reads the KV pool in place: kiln's paged layout, no gather of the past.
//
//   q        [B, S, heads * hd]      the call's queries (rotated)
//   k, v     [B, S, kv_heads * hd]   the call's new keys and values (rotated keys); not yet in the pool
//   pool     [kv_heads, num_blocks, block_size, hd]   key_cache / value_cache of the layer
//   tables   [B, max_blocks] int64   each row's blocks, in order; past_lens [B] int64
//   out      [B, S, heads * hd]
//
// Query s of row b sits at position past_lens[b] + s. It sees the row's past tokens (read from the
// blocks of its table) and the call's new tokens 0..s: the causal rule, with padding tokens only
// ever to the right of a row's real ones. With window W > 0 a key at position p is seen iff
// query position - p < W; with softcap c > 0 a score x becomes c * tanh(x / c) (Gemma 2).
#pragma once

#include <cstdint>

namespace kiln_attn {

constexpr int kMaxHeadDim = 256;     // the op refuses wider heads

struct Shape {
  int batch, seq, heads, kv_heads, head_dim, num_blocks, block_size, max_blocks;
};

struct Params {
  float scale = 0.f;      // the scores' factor (head_dim^-0.5 unless the family says otherwise)
  float softcap = 0.f;    // 0: none
  int window = 0;         // 0: none
};

// Empty when tables and past_lens fit the pool; otherwise what is wrong.
const char* CheckTables(const Shape& s, const int64_t* tables, const int64_t* past_lens);

// One task: query head h of row b, queries [s0, s1). Tasks write disjoint parts of out.
void AttendTask(const Shape& s, const Params& p, const float* q, const float* k, const float* v,
                const float* key_pool, const float* value_pool, const int64_t* tables,
                const int64_t* past_lens, int b, int h, int s0, int s1, float* out);

}  // namespace kiln_attn
