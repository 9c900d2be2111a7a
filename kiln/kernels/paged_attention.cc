// kiln.PagedAttention's arithmetic (paged_attention.h). build.py compiles this file once per level
// with that level's flags (scalar, avx2, avx512) and -DKILN_ATTEND_TASK=AttendTask<Level>, the one
// name each copy exports; the kernel table (kernels.h) picks the copy for the CPU. Its inner loops
// (dot products, the softmax's exponentials, the weighted sum of values) are inlined into each copy,
// so they vectorize for that copy's instructions with no call between. NOTE: like every per-level
// file it instantiates no std:: template (its scratch is kernels.h's ScratchMemory).
#include <cmath>
#include <cstring>

#include "kernels.h"

#ifndef KILN_ATTEND_TASK
#error "compiled per level by kiln/kernels/build.py, which names the copy (-DKILN_ATTEND_TASK=AttendTaskAvx2)"
#endif

namespace kiln {
namespace {

using Shape = AttentionShape;
using Params = AttentionParams;

#include "attention_math.h"     // Lanes, Total, ExpLanes, ExpAndSum (inside this anonymous namespace)

KILN_INLINE float Dot(const float* a, const float* b, int n) {
  Lanes8 acc0 = {}, acc1 = {};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 += Load<Lanes8>(a + i) * Load<Lanes8>(b + i);
    acc1 += Load<Lanes8>(a + i + 8) * Load<Lanes8>(b + i + 8);
  }
  float sum = Total8(acc0 + acc1);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

KILN_INLINE void AddScaled(float* out, float p, const float* v, int n) {
  for (int i = 0; i < n; ++i) out[i] += p * v[i];
}

// out += w[0] v[0] + ... + w[3] v[3]: one load and store of out per four value rows, so the sum does
// not wait on a store per row.
KILN_INLINE void AddScaled4(float* out, const float* w, const float* const* v, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const Lanes8 sum = Load<Lanes8>(out + i) + w[0] * Load<Lanes8>(v[0] + i) + w[1] * Load<Lanes8>(v[1] + i) + w[2] * Load<Lanes8>(v[2] + i) +
                       w[3] * Load<Lanes8>(v[3] + i);
    std::memcpy(out + i, &sum, sizeof sum);
  }
  for (; i < n; ++i) out[i] += w[0] * v[0][i] + w[1] * v[1][i] + w[2] * v[2][i] + w[3] * v[3][i];
}

KILN_INLINE float Cap(float score, const Params& p) { return p.softcap > 0.f ? p.softcap * std::tanh(score / p.softcap) : score; }

// Where a task reads: key index t of its row is a past token (t < past, in the pool through the
// row's block table) or the call's new token t - past.
struct RowView {
  const Shape& s;
  int64_t past;
  const int64_t* table;
  const float *pool_keys, *pool_values, *new_keys, *new_values;
  size_t new_stride, new_base;

  KILN_INLINE const float* Row(const float* pool, const float* fresh, int64_t t) const {
    if (t < past) {
      const int64_t block = table[t / s.block_size];
      return pool + (static_cast<size_t>(block) * s.block_size + t % s.block_size) * s.head_dim;
    }
    return fresh + new_base + static_cast<size_t>(t - past) * new_stride;
  }
  // fn(i, row) for keys t = first .. last, i = t - first: one block-table lookup per block, not per key.
  template <typename Fn>
  KILN_INLINE void Walk(const float* pool, const float* fresh, int64_t first, int64_t last, Fn fn) const {
    int64_t t = first;
    while (t <= last && t < past) {
      const int64_t block = table[t / s.block_size], offset = t % s.block_size;
      int64_t run = s.block_size - offset;
      run = past - t < run ? past - t : run;
      run = last - t + 1 < run ? last - t + 1 : run;
      const float* base = pool + (static_cast<size_t>(block) * s.block_size + offset) * s.head_dim;
      for (int64_t i = 0; i < run; ++i) fn(static_cast<int>(t + i - first), base + i * s.head_dim);
      t += run;
    }
    for (; t <= last; ++t) fn(static_cast<int>(t - first), fresh + new_base + static_cast<size_t>(t - past) * new_stride);
  }
  KILN_INLINE const float* Key(int64_t t) const { return Row(pool_keys, new_keys, t); }
  KILN_INLINE const float* Value(int64_t t) const { return Row(pool_values, new_values, t); }
};

constexpr int kLanes = 16;
constexpr int kMinChunk = 4;
constexpr int kKeys = 4;           // keys a chunk's loops take per pass (the value loop spells out 4)       // queries from which a task computes across them (prefill)

// The keys query position `position` sees: [first, position].
KILN_INLINE int64_t FirstKey(const Params& p, int64_t position) {
  return p.window > 0 && position - p.window + 1 > 0 ? position - p.window + 1 : 0;
}

// Softmax over scores[0, n) and the weighted sum of the values of keys first.. into result.
KILN_INLINE void Finish(const RowView& row, float* scores, int n, int64_t first, int hd, float* result) {
  float top = -INFINITY;
  for (int t = 0; t < n; ++t) top = scores[t] > top ? scores[t] : top;
  const float inv = 1.f / ExpAndSum(scores, n, top);
  std::memset(result, 0, sizeof(float) * hd);
  const float* rows[4];
  float weights[4];
  int pending = 0;
  row.Walk(row.pool_values, row.new_values, first, first + n - 1, [&](int t, const float* value) {
    rows[pending] = value;
    weights[pending++] = scores[t] * inv;
    if (pending == 4) {
      AddScaled4(result, weights, rows, hd);
      pending = 0;
    }
  });
  for (int i = 0; i < pending; ++i) AddScaled(result, weights[i], rows[i], hd);
}

// A chunk's scores for kKeys keys, acc[j][i] = sum_d transposed[d][i] * key[j][d], as 8-float halves
// with every sum in a named register: much faster than the 16-float loop on one AVX2 thread
// (docs/results/2026-12-06-figures-from-code-comments.md).
static_assert(kKeys == 4, "ScoresInHalves names its four keys' sums");
KILN_INLINE void ScoresInHalves(const Lanes* transposed, const float* const* key, int hd, Lanes* acc) {
  const float *k0 = key[0], *k1 = key[1], *k2 = key[2], *k3 = key[3];
  const float* tq = reinterpret_cast<const float*>(transposed);
  Lanes8 l0 = {}, l1 = {}, l2 = {}, l3 = {}, h0 = {}, h1 = {}, h2 = {}, h3 = {};
  for (int d = 0; d < hd; ++d) {
    const Lanes8 lo = Load<Lanes8>(tq + d * kLanes), hi = Load<Lanes8>(tq + d * kLanes + 8);
    l0 += lo * k0[d];
    h0 += hi * k0[d];
    l1 += lo * k1[d];
    h1 += hi * k1[d];
    l2 += lo * k2[d];
    h2 += hi * k2[d];
    l3 += lo * k3[d];
    h3 += hi * k3[d];
  }
  const Lanes8 halves[kKeys][2] = {{l0, h0}, {l1, h1}, {l2, h2}, {l3, h3}};
  std::memcpy(acc, halves, sizeof(Lanes) * kKeys);
}

// out[d] += the kKeys keys' scores times their values' element d, as ScoresInHalves does it: each
// 16-float vector as two 8-float halves in named registers (the 16-float loop, on AVX2, stored every
// out[d] through general registers, 128 bits at a time: a large share of a prefill's attention).
// The same products and order of additions per lane as the 16-float loop.
KILN_INLINE void ValuesInHalves(const Lanes* scores, const float* const* value, int hd, Lanes* out) {
  Lanes8 half[kKeys][2];
  std::memcpy(half, scores, sizeof(Lanes) * kKeys);
  const Lanes8 l0 = half[0][0], l1 = half[1][0], l2 = half[2][0], l3 = half[3][0];
  const Lanes8 h0 = half[0][1], h1 = half[1][1], h2 = half[2][1], h3 = half[3][1];
  const float *v0 = value[0], *v1 = value[1], *v2 = value[2], *v3 = value[3];
  float* o = reinterpret_cast<float*>(out);
  for (int d = 0; d < hd; ++d) {
    const Lanes8 lo = Load<Lanes8>(o + d * kLanes) + (l0 * v0[d] + l1 * v1[d] + l2 * v2[d] + l3 * v3[d]);
    const Lanes8 hi = Load<Lanes8>(o + d * kLanes + 8) + (h0 * v0[d] + h1 * v1[d] + h2 * v2[d] + h3 * v3[d]);
    std::memcpy(o + d * kLanes, &lo, sizeof lo);
    std::memcpy(o + d * kLanes + 8, &hi, sizeof hi);
  }
}

// A chunk of up to 16 queries (prefill), computed across the queries: lane i of every vector is query
// s0 + i. Per key, its 16 scores are one multiply-add per head dimension (the key's element times the
// queries' transposed elements), with no horizontal sums; the softmax and the weighted sum of values
// run on the same lanes. Lanes past the chunk or keys a query cannot see are masked out.
template <typename Query, typename Result>
KILN_INLINE void AttendChunk(const Shape& s, const Params& p, const RowView& row, Query query, Result result,
                             int s0, int s1) {
  const int hd = s.head_dim, nq = s1 - s0;
  Lanes transposed[kMaxHeadDim];                      // transposed[d][i] = query s0 + i, element d
  for (int d = 0; d < hd; ++d) transposed[d] = Lanes{};
  for (int i = 0; i < nq; ++i)
    for (int d = 0; d < hd; ++d) transposed[d][i] = query(s0 + i)[d];
  Lanes position{}, first{};                          // per lane: the query's position, its first key
  for (int i = 0; i < kLanes; ++i) {
    const int64_t at = row.past + s0 + (i < nq ? i : nq - 1);
    position[i] = static_cast<float>(at);
    first[i] = static_cast<float>(FirstKey(p, at));
  }
  const int64_t lo = FirstKey(p, row.past + s0), hi = row.past + s1 - 1;
  // NOTE: where a 16-float vector is one register (AVX-512) the loop below compiles well; without,
  // GCC spilled its sums and rebuilt the key pointers every pass (8 GFLOP/s on one AVX2 thread)
#ifdef __AVX512F__
  constexpr bool wide = true;
#else
  constexpr bool wide = false;
#endif
  const int width = static_cast<int>(hi - lo + 1);
  // scores[t - lo]: key t against every query. NOTE: floats, aligned by hand: a std::vector of
  // 64-byte vectors was not allocated 64-byte aligned, and the stores into it are aligned ones.
  Lanes* scores = static_cast<Lanes*>(ScratchMemory(Scratch::kAttentionChunk, static_cast<size_t>(width) * sizeof(Lanes)));
  Lanes top = Lanes{} - INFINITY;
  // NOTE: kKeys keys per pass: their sums are independent chains (one chain waits out each
  // multiply-add's latency) and share each load of the transposed queries.
  for (int64_t t0 = lo; t0 <= hi; t0 += kKeys) {
    const int n = static_cast<int>(hi - t0 + 1 < kKeys ? hi - t0 + 1 : kKeys);
    const float* key[kKeys];
    for (int j = 0; j < kKeys; ++j) key[j] = row.Key(t0 + (j < n ? j : 0));
    Lanes acc[kKeys] = {};
    if (wide) {
      for (int d = 0; d < hd; ++d)
        for (int j = 0; j < kKeys; ++j) acc[j] += transposed[d] * key[j][d];
    } else {
      ScoresInHalves(transposed, key, hd, acc);
    }
    for (int j = 0; j < n; ++j) {
      Lanes x = acc[j] * p.scale;
      if (p.softcap > 0.f)
        for (int i = 0; i < kLanes; ++i) x[i] = Cap(x[i], p);
      const float tf = static_cast<float>(t0 + j);
      x = (tf <= position) & (tf >= first) ? x : Lanes{} - INFINITY;     // positions are exact in float below 2^24
      scores[t0 + j - lo] = x;
      top = x > top ? x : top;
    }
  }
  Lanes total{};
  for (int t = 0; t < width; ++t) {
    const Lanes seen = scores[t] > Lanes{} - INFINITY ? Lanes{} + 1.f : Lanes{};
    scores[t] = ExpLanes(scores[t] - top) * seen;
    total += scores[t];
  }
  Lanes out[kMaxHeadDim];                             // out[d][i]: query s0 + i, element d
  for (int d = 0; d < hd; ++d) out[d] = Lanes{};
  int t = 0;
  for (; t + kKeys <= width; t += kKeys) {
    const float* value[kKeys];
    for (int j = 0; j < kKeys; ++j) value[j] = row.Value(lo + t + j);
    if (wide) {
      for (int d = 0; d < hd; ++d)
        out[d] += scores[t] * value[0][d] + scores[t + 1] * value[1][d] + scores[t + 2] * value[2][d] +
                  scores[t + 3] * value[3][d];
    } else {
      ValuesInHalves(scores + t, value, hd, out);
    }
  }
  for (; t < width; ++t) {
    const float* value = row.Value(lo + t);
    for (int d = 0; d < hd; ++d) out[d] += scores[t] * value[d];
  }
  for (int i = 0; i < nq; ++i) {
    float* dst = result(s0 + i);
    const float inv = 1.f / total[i];
    for (int d = 0; d < hd; ++d) dst[d] = out[d][i] * inv;
  }
}

}  // namespace

void KILN_ATTEND_TASK(const Shape& s, const Params& p, const float* q, const float* k, const float* v,
                      const float* key_pool, const float* value_pool, const int64_t* tables,
                      const int64_t* past_lens, int b, int h, int s0, int s1, float* out) {
  const int hd = s.head_dim, g = h / (s.heads / s.kv_heads);
  const size_t head_rows = static_cast<size_t>(s.num_blocks) * s.block_size;      // one kv head's rows in the pool
  const size_t kv_stride = static_cast<size_t>(s.kv_heads) * hd;
  const RowView row{s, past_lens[b], tables + static_cast<int64_t>(b) * s.max_blocks,
                    key_pool + g * head_rows * hd, value_pool + g * head_rows * hd, k, v, kv_stride,
                    static_cast<size_t>(b) * s.seq * kv_stride + static_cast<size_t>(g) * hd};
  const auto query = [&](int qs) { return q + ((static_cast<size_t>(b) * s.seq + qs) * s.heads + h) * hd; };
  const auto result = [&](int qs) { return out + ((static_cast<size_t>(b) * s.seq + qs) * s.heads + h) * hd; };
  if (s1 - s0 >= kMinChunk) return AttendChunk(s, p, row, query, result, s0, s1);
  for (int qs = s0; qs < s1; ++qs) {
    const int64_t position = row.past + qs, first = FirstKey(p, position);
    const int n = static_cast<int>(position - first + 1);
    float* scores = static_cast<float*>(ScratchMemory(Scratch::kAttention, sizeof(float) * n));
    const float* qv = query(qs);
    row.Walk(row.pool_keys, row.new_keys, first, position,
             [&](int t, const float* key) { scores[t] = p.scale * Dot(qv, key, hd); });
    if (p.softcap > 0.f)
      for (int t = 0; t < n; ++t) scores[t] = Cap(scores[t], p);
    Finish(row, scores, n, first, hd, result(qs));
  }
}

}  // namespace kiln
