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
//
// One copy of the arithmetic per level (paged_attention.cc, compiled by build.py once for each of
// scalar, avx2 and avx512 as AttendTask<Level>); kernels.h's table picks the copy.
#pragma once

#include <cstdint>

namespace kiln {

constexpr int kMaxHeadDim = 256;     // the op refuses wider heads

struct AttentionShape {
  int batch, seq, heads, kv_heads, head_dim, num_blocks, block_size, max_blocks;
};

struct AttentionParams {
  float scale = 0.f;      // the scores' factor (head_dim^-0.5 unless the family says otherwise)
  float softcap = 0.f;    // 0: none
  int window = 0;         // 0: none
};

// Empty when tables and past_lens fit the pool; otherwise what is wrong. NOTE: past_lens come from
// the caller (a graph input): the blocks a past uses are counted without past + block_size - 1, which
// overflows near INT64_MAX, and a row's positions (past + seq) must fit the kernel's int.
inline const char* CheckTables(const AttentionShape& s, const int64_t* tables, const int64_t* past_lens) {
  for (int b = 0; b < s.batch; ++b) {
    const int64_t past = past_lens[b];
    if (past < 0 || past / s.block_size + (past % s.block_size != 0) > s.max_blocks)
      return "a past length is negative or longer than its row of block_tables holds";
    if (past > INT32_MAX - static_cast<int64_t>(s.seq))
      return "a past length puts a row's positions past 2^31 - 1";
    const int64_t used = past / s.block_size + (past % s.block_size != 0);
    for (int64_t i = 0; i < used; ++i) {
      const int64_t block = tables[static_cast<int64_t>(b) * s.max_blocks + i];
      if (block < 0 || block >= s.num_blocks) return "a block id in block_tables is outside the KV pool";
    }
  }
  return nullptr;
}

// One task: query head h of row b, queries [s0, s1). Tasks write disjoint parts of out.
using AttendFn = void (*)(const AttentionShape& s, const AttentionParams& p, const float* q, const float* k,
                          const float* v, const float* key_pool, const float* value_pool, const int64_t* tables,
                          const int64_t* past_lens, int b, int h, int s0, int s1, float* out);

void AttendTaskScalar(const AttentionShape&, const AttentionParams&, const float*, const float*, const float*,
                      const float*, const float*, const int64_t*, const int64_t*, int, int, int, int, float*);
void AttendTaskAvx2(const AttentionShape&, const AttentionParams&, const float*, const float*, const float*,
                    const float*, const float*, const int64_t*, const int64_t*, int, int, int, int, float*);
void AttendTaskAvx512(const AttentionShape&, const AttentionParams&, const float*, const float*, const float*,
                      const float*, const float*, const int64_t*, const int64_t*, int, int, int, int, float*);

}  // namespace kiln
