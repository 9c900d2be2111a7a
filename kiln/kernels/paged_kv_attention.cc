// kiln.PagedAttentionU8's and kiln.PagedAttentionF16's arithmetic (paged_kv_attention.h). build.py
// compiles this file once per level with that level's flags, naming its entries
// -DKILN_ATTEND_KV=AttendKv<Level> and -DKILN_STORE_TOKEN=StoreToken<Level>; the kernel table
// (kernels.h) picks the copy for the CPU.
//
// A task is one sequence, one kv head and a run of its new tokens: every query head of the group
// (GQA) meets each key and value once per task, so a decode step reads the cache once per kv head,
// not once per query head. A block holds 16 keys' codes of one head dimension side by side (in
// paged_kv_attention.h's layouts), so they are one load: a query's 16 scores are one multiply-add per
// head dimension, with no sums across lanes. The softmax runs as the blocks come (flash decoding), so each
// block's keys and values are read once. NOTE: like every per-level file it instantiates no std::
// template.
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "paged_kv_attention.h"

#if !defined(KILN_ATTEND_KV) || !defined(KILN_STORE_TOKEN)
#error "compiled per level by kiln/kernels/build.py, which names the copies (-DKILN_ATTEND_KV=AttendKvAvx2 ...)"
#endif

namespace kiln {
namespace {

#include "attention_math.h"     // Lanes, Load, Total, ExpLanes, ExpAndSum (inside this anonymous namespace)

constexpr int kLanes = 16;
constexpr int kQueryGroup = 4;      // query vectors whose sums one pass keeps in registers
constexpr int kMaxBlockHalves = 4;  // blocks of up to 64 tokens, 16 at a time
const Lanes kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

#include "kv_elements.h"       // U8Codes, F16Values, Prefetch

// A span already widened (a task of many queries reads it once per group of four): keys [hd][bs],
// values [bs][hd].
struct F32Values {
  static constexpr KvFormat kFormat = KvFormat::kF32;
  static constexpr bool kAffine = false;
  static constexpr bool kFromMemory = false;   // in cache already: asking ahead only costs
  static KILN_INLINE Lanes Keys(const uint8_t* x, int bs, int d, int h16) {
    return Load(reinterpret_cast<const float*>(x) + static_cast<size_t>(d) * bs + h16);
  }
  static KILN_INLINE Lanes Values(const uint8_t* x, int hd, int slot, int c) {
    return Load(reinterpret_cast<const float*>(x) + static_cast<size_t>(slot) * hd + c);
  }
};

KILN_INLINE int64_t FirstKey(const AttentionParams& p, int64_t position) {
  return p.window > 0 && position - p.window + 1 > 0 ? position - p.window + 1 : 0;
}

// One query vector of a task: a token's query for one head, and the keys it sees.
struct Query {
  const float* x;
  float sum;                  // of x: the keys' minimum times it is their rows' share of each score
  int64_t first, last;        // keys first .. last
  float* out;
};

struct Span {
  int64_t base, lo, hi;       // blocks from base (lo's block start); keys lo .. hi are read
};

// The running softmax of J queries over the keys seen so far (flash decoding): the largest score,
// the sum of e^(score - largest), and the weighted sums of values, all scaled to that largest.
template <int J, int C>
struct Running {
  float top[J], minimum_share[J];
  Lanes total[J];             // per lane; summed across lanes at the end
  Lanes acc[J][C];

  Running() {
    for (int j = 0; j < J; ++j) {
      top[j] = -INFINITY;
      total[j] = Lanes{};
      minimum_share[j] = 0.f;
      for (int c = 0; c < C; ++c) acc[j][c] = Lanes{};
    }
  }
};

// acc[j] (the 16 keys from t0 against query j) into scores: the rows' scale and minimum, the
// softcap, and -inf where query j does not see the key.
template <typename F, int J>
KILN_INLINE void FinishScores(const AttentionParams& p, const Segment& seg, int h16, int64_t t0, const Query* qs,
                              Lanes* acc, Lanes* scores) {
  if constexpr (F::kAffine) {
    const Lanes scale = Load(seg.scale + h16), minimum = Load(seg.minimum + h16);
    for (int j = 0; j < J; ++j) acc[j] = acc[j] * scale + minimum * qs[j].sum;
  }
  const Lanes key = kIota + static_cast<float>(t0);            // positions are exact in float below 2^24
  for (int j = 0; j < J; ++j) {
    Lanes x = acc[j] * p.scale;
    if (p.softcap > 0.f)
      for (int i = 0; i < kLanes; ++i) x[i] = p.softcap * std::tanh(x[i] / p.softcap);
    const Lanes first = Lanes{} + static_cast<float>(qs[j].first), last = Lanes{} + static_cast<float>(qs[j].last);
    scores[j] = (key >= first) & (key <= last) ? x : Lanes{} - INFINITY;
  }
}

// The scores of J queries for the 16 keys from t0 (h16 into their block) ...
template <typename F, int J>
KILN_INLINE void ScoreKeys(const AttentionParams& p, const Segment& seg, int bs, int hd, int h16, int64_t t0,
                           const Query* qs, Lanes* scores) {
  Lanes acc[J];
  for (int j = 0; j < J; ++j) acc[j] = Lanes{};
  for (int d = 0; d < hd; ++d) {
    const Lanes c = F::Keys(seg.codes, bs, d, h16);
    for (int j = 0; j < J; ++j) acc[j] += qs[j].x[d] * c;
  }
  FinishScores<F, J>(p, seg, h16, t0, qs, acc, scores);
}

// ... and for the 32 from t0 at once: twice the independent sums per pass, so the multiply-adds do
// not wait on each other's results.
template <typename F, int J>
KILN_INLINE void ScoreKeyPairs(const AttentionParams& p, const Segment& seg, int bs, int hd, int h16, int64_t t0,
                               const Query* qs, Lanes* scores, Lanes* next_scores) {
  Lanes acc[J], next[J];
  for (int j = 0; j < J; ++j) acc[j] = next[j] = Lanes{};
  for (int d = 0; d < hd; ++d) {
    const Lanes c = F::Keys(seg.codes, bs, d, h16), c_next = F::Keys(seg.codes, bs, d, h16 + kLanes);
    for (int j = 0; j < J; ++j) {
      acc[j] += qs[j].x[d] * c;
      next[j] += qs[j].x[d] * c_next;
    }
  }
  FinishScores<F, J>(p, seg, h16, t0, qs, acc, scores);
  FinishScores<F, J>(p, seg, h16 + kLanes, t0 + kLanes, qs, next, next_scores);
}

// The largest lane, by halving as Total sums.
KILN_INLINE float Largest(Lanes v) {
  Lanes8 half[2];
  std::memcpy(half, &v, sizeof v);
  Lanes8 m = half[0] > half[1] ? half[0] : half[1];
  Lanes8 t = __builtin_shuffle(m, LaneIndex8{4, 5, 6, 7, 0, 1, 2, 3});
  m = m > t ? m : t;
  t = __builtin_shuffle(m, LaneIndex8{2, 3, 0, 1, 6, 7, 4, 5});
  m = m > t ? m : t;
  t = __builtin_shuffle(m, LaneIndex8{1, 0, 3, 2, 5, 4, 7, 6});
  m = m > t ? m : t;
  return m[0];
}

// One block of keys [b0, b0 + bs) into the running softmax: its scores, the rescale when a query's
// largest score grows, then its values weighted by e^(score - largest).
template <typename F, int J, int C>
KILN_INLINE void TakeBlock(const PackedAttention& s, const AttentionParams& p, const Segment& keys,
                           const Segment& values, int64_t b0, const Span& span, const Query* qs, Running<J, C>& run) {
  const int bs = s.block_size, hd = C * kLanes;
  constexpr int kHalves = kMaxBlockHalves;
  Lanes scores[kHalves][J];
  const int halves = bs / kLanes;
  const auto unseen = [&](int h) { return b0 + h * kLanes > span.hi || b0 + (h + 1) * kLanes <= span.lo; };
  for (int h = 0; h < halves;) {
    if (h + 1 < halves && !unseen(h) && !unseen(h + 1)) {
      ScoreKeyPairs<F, J>(p, keys, bs, hd, h * kLanes, b0 + h * kLanes, qs, scores[h], scores[h + 1]);
      h += 2;
      continue;
    }
    if (unseen(h))
      for (int j = 0; j < J; ++j) scores[h][j] = Lanes{} - INFINITY;
    else
      ScoreKeys<F, J>(p, keys, bs, hd, h * kLanes, b0 + h * kLanes, qs, scores[h]);
    ++h;
  }
  float weight[J][kHalves * kLanes];
  for (int j = 0; j < J; ++j) {
    Lanes most = scores[0][j];
    for (int h = 1; h < halves; ++h) most = scores[h][j] > most ? scores[h][j] : most;
    const float block_top = Largest(most);
    if (block_top == -INFINITY) {                               // nothing of this block seen by query j
      for (int i = 0; i < bs; ++i) weight[j][i] = 0.f;
      continue;
    }
    if (block_top > run.top[j]) {                               // the sums so far, scaled to the new largest
      const float rescale = std::exp(run.top[j] - block_top);   // 0 when nothing was seen before
      run.top[j] = block_top;
      run.total[j] *= rescale;
      run.minimum_share[j] *= rescale;
      for (int c = 0; c < C; ++c) run.acc[j][c] *= rescale;
    }
    const float top = run.top[j];
    for (int h = 0; h < halves; ++h) {
      const Lanes seen = scores[h][j] > Lanes{} - INFINITY ? Lanes{} + 1.f : Lanes{};
      const Lanes e = ExpLanes(scores[h][j] - top) * seen;
      run.total[j] += e;
      std::memcpy(weight[j] + h * kLanes, &e, sizeof e);
    }
  }
  const int i0 = b0 < span.lo ? static_cast<int>(span.lo - b0) : 0;
  const int i1 = static_cast<int>(span.hi - b0 + 1 < bs ? span.hi - b0 + 1 : bs);
  if constexpr (F::kAffine)       // each row's scale into its weight, its minimum into the share
    for (int j = 0; j < J; ++j)
      for (int i = i0; i < i1; ++i) {
        run.minimum_share[j] += weight[j][i] * values.minimum[i];
        weight[j][i] *= values.scale[i];
      }
  // NOTE: the sums in locals: run's, reached through a reference, would be stored and reloaded
  // every row (the byte loads may alias them).
  Lanes acc[J][C];
  for (int j = 0; j < J; ++j)
    for (int c = 0; c < C; ++c) acc[j][c] = run.acc[j][c];
  for (int i = i0; i < i1; ++i) {
    Lanes v[C];
    for (int c = 0; c < C; ++c) v[c] = F::Values(values.codes, hd, i, c * kLanes);
    for (int j = 0; j < J; ++j)
      for (int c = 0; c < C; ++c) acc[j][c] += weight[j][i] * v[c];
  }
  for (int j = 0; j < J; ++j)
    for (int c = 0; c < C; ++c) run.acc[j][c] = acc[j][c];
}

// A task's keys for J queries: block by block, each block's keys and values read once, the next
// block's asked for while this one computes.
template <typename F, int J, int C>
void AttendGroup(const PackedAttention& s, const AttentionParams& p, const uint8_t* key_cache,
                 const uint8_t* value_cache, const PackedSequence& seq, int g, const Query* qs, const Span& span) {
  const int bs = s.block_size;
  const size_t segment = SegmentBytes(s.head_dim, bs, F::kFormat);
  Running<J, C> run;
  for (int64_t b0 = span.base; b0 <= span.hi; b0 += bs) {
    if (F::kFromMemory && b0 + bs <= span.hi) {
      const int64_t next = seq.blocks[(b0 + bs) / bs];
      Prefetch<3>(SegmentOf(s, key_cache, next, g, F::kFormat).codes, segment);
      Prefetch<3>(SegmentOf(s, value_cache, next, g, F::kFormat).codes, segment);
    }
    const int64_t block = seq.blocks[b0 / bs];
    TakeBlock<F, J, C>(s, p, SegmentOf(s, key_cache, block, g, F::kFormat), SegmentOf(s, value_cache, block, g, F::kFormat),
                       b0, span, qs, run);
  }
  for (int j = 0; j < J; ++j)
    for (int c = 0; c < C; ++c) {
      const Lanes v = (run.acc[j][c] + run.minimum_share[j]) * (1.f / Total(run.total[j]));
      std::memcpy(qs[j].out + c * kLanes, &v, sizeof v);
    }
}

template <typename F, int C>
void AttendQueries(const PackedAttention& s, const AttentionParams& p, const uint8_t* key_cache,
                   const uint8_t* value_cache, const PackedSequence& seq, int g, const Query* qs, int count,
                   const Span& span) {
  for (int j0 = 0; j0 < count; j0 += kQueryGroup) {
    const Query* group = qs + j0;
    switch (count - j0 < kQueryGroup ? count - j0 : kQueryGroup) {
      case 1: AttendGroup<F, 1, C>(s, p, key_cache, value_cache, seq, g, group, span); break;
      case 2: AttendGroup<F, 2, C>(s, p, key_cache, value_cache, seq, g, group, span); break;
      case 3: AttendGroup<F, 3, C>(s, p, key_cache, value_cache, seq, g, group, span); break;
      default: AttendGroup<F, 4, C>(s, p, key_cache, value_cache, seq, g, group, span); break;
    }
  }
}

}  // namespace

namespace {

KILN_INLINE uint16_t FloatToHalf(float x) {
#if defined(__F16C__)
  return static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
#else
  // round to nearest even, as the F16C instruction does
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t sign = (bits >> 16) & 0x8000;
  const float a = std::fabs(x);
  if (!(a == a)) return static_cast<uint16_t>(sign | 0x7e00);
  if (a >= 65520.f) return static_cast<uint16_t>(sign | 0x7c00);
  if (a < 6.103515625e-05f) return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.f)));
  std::memcpy(&bits, &a, sizeof bits);
  const uint32_t rounded = bits + 0xfff + ((bits >> 13) & 1);
  return static_cast<uint16_t>(sign | ((rounded - (112u << 23)) >> 13));
#endif
}

#ifdef __AVX512F__
// The same codes as the loop below (the same f32 operations, rounded to nearest even), 16 at a time:
// a prefill stores every token of every kv head before it attends.
void StoreU8(const float* x, int hd, int bs, uint8_t* segment, int slot, bool keys) {
  __m512 lowest = _mm512_loadu_ps(x), highest = lowest;
  for (int d = kLanes; d < hd; d += kLanes) {
    const __m512 v = _mm512_loadu_ps(x + d);
    lowest = _mm512_min_ps(lowest, v);
    highest = _mm512_max_ps(highest, v);
  }
  const float lo = _mm512_reduce_min_ps(lowest), hi = _mm512_reduce_max_ps(highest);
  const float scale = (hi - lo) / 255.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
  for (int d = 0; d < hd; d += kLanes) {
    const __m512 scaled = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + d), _mm512_set1_ps(lo)), _mm512_set1_ps(inverse));
    const __m128i codes = _mm512_cvtusepi32_epi8(_mm512_max_epi32(_mm512_cvtps_epi32(scaled), _mm512_setzero_si512()));
    alignas(16) uint8_t lanes[kLanes];
    _mm_store_si128(reinterpret_cast<__m128i*>(lanes), codes);
    if (keys)       // a key's 4 consecutive dimensions are one word
      for (int i = 0; i < kLanes; i += 4) std::memcpy(segment + U8Codes::KeyAt(bs, d + i, slot), lanes + i, 4);
    else
      for (int i = 0; i < kLanes; ++i) segment[U8Codes::ValueAt(hd, d + i, slot)] = lanes[i];
  }
  std::memcpy(segment + static_cast<size_t>(hd) * bs + sizeof(float) * slot, &scale, sizeof scale);
  std::memcpy(segment + static_cast<size_t>(hd) * bs + sizeof(float) * (bs + slot), &lo, sizeof lo);
}
#else
void StoreU8(const float* x, int hd, int bs, uint8_t* segment, int slot, bool keys) {
  float lo = x[0], hi = x[0];
  for (int d = 1; d < hd; ++d) {
    lo = x[d] < lo ? x[d] : lo;
    hi = x[d] > hi ? x[d] : hi;
  }
  const float scale = (hi - lo) / 255.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
  for (int d = 0; d < hd; ++d) {
    const float code = std::nearbyint((x[d] - lo) * inverse);
    const size_t at = keys ? U8Codes::KeyAt(bs, d, slot) : U8Codes::ValueAt(hd, d, slot);
    segment[at] = static_cast<uint8_t>(code < 0.f ? 0.f : (code > 255.f ? 255.f : code));
  }
  std::memcpy(segment + static_cast<size_t>(hd) * bs + sizeof(float) * slot, &scale, sizeof scale);
  std::memcpy(segment + static_cast<size_t>(hd) * bs + sizeof(float) * (bs + slot), &lo, sizeof lo);
}
#endif

void StoreF16(const float* x, int hd, int bs, uint8_t* segment, int slot, bool keys) {
  for (int d = 0; d < hd; ++d) {
    const uint16_t h = FloatToHalf(x[d]);
    const size_t at = keys ? static_cast<size_t>(d) * bs + slot : static_cast<size_t>(slot) * hd + d;
    std::memcpy(segment + 2 * at, &h, sizeof h);
  }
}

template <typename F>
void AttendSpan(const PackedAttention& s, const AttentionParams& p, const uint8_t* key_cache,
                const uint8_t* value_cache, const PackedSequence& seq, int g, const Query* qs, int count,
                const Span& span) {
  using Fn = void (*)(const PackedAttention&, const AttentionParams&, const uint8_t*, const uint8_t*,
                      const PackedSequence&, int, const Query*, int, const Span&);
  static constexpr Fn kByChunks[] = {nullptr, AttendQueries<F, 1>, AttendQueries<F, 2>, AttendQueries<F, 3>,
                                     AttendQueries<F, 4>, AttendQueries<F, 5>, AttendQueries<F, 6>,
                                     AttendQueries<F, 7>, AttendQueries<F, 8>, AttendQueries<F, 9>,
                                     AttendQueries<F, 10>, AttendQueries<F, 11>, AttendQueries<F, 12>,
                                     AttendQueries<F, 13>, AttendQueries<F, 14>, AttendQueries<F, 15>,
                                     AttendQueries<F, 16>};
  static_assert(sizeof(kByChunks) / sizeof(kByChunks[0]) == kMaxHeadDim / kLanes + 1, "a copy per head width");
  kByChunks[s.head_dim / kLanes](s, p, key_cache, value_cache, seq, g, qs, count, span);
}

// One block's keys or values of kv head g as f32, in F32Values' layout.
template <typename F>
void WidenBlock(const Segment& seg, int bs, int hd, bool keys, float* out) {
  if (keys) {
    for (int d = 0; d < hd; ++d)
      for (int h16 = 0; h16 < bs; h16 += kLanes) {
        Lanes x = F::Keys(seg.codes, bs, d, h16);
        if constexpr (F::kAffine) x = x * Load(seg.scale + h16) + Load(seg.minimum + h16);
        std::memcpy(out + static_cast<size_t>(d) * bs + h16, &x, sizeof x);
      }
    return;
  }
  for (int i = 0; i < bs; ++i)
    for (int c = 0; c < hd; c += kLanes) {
      Lanes x = F::Values(seg.codes, hd, i, c);
      if constexpr (F::kAffine) x = x * seg.scale[i] + seg.minimum[i];
      std::memcpy(out + static_cast<size_t>(i) * hd + c, &x, sizeof x);
    }
}

// Many queries (a prefill's run of tokens): the span's blocks are widened to f32 once, into scratch
// laid out as a pool of one kv head whose blocks are the span's in order, and every group of four
// queries reads that copy (widening each block once per group cost more than the products).
template <typename F>
void AttendWidened(const PackedAttention& s, const AttentionParams& p, const uint8_t* key_cache,
                   const uint8_t* value_cache, const PackedSequence& seq, int g, const Query* qs, int count,
                   const Span& span) {
  const int bs = s.block_size, hd = s.head_dim;
  const int first = static_cast<int>(span.base / bs), blocks = static_cast<int>(span.hi / bs) - first + 1;
  const size_t segment = SegmentBytes(hd, bs, KvFormat::kF32);
  auto* copy = static_cast<uint8_t*>(ScratchMemory(Scratch::kAttentionChunk, 2 * segment * blocks));
  uint8_t* keys = copy;
  uint8_t* values = copy + segment * blocks;
  auto* order = static_cast<int32_t*>(ScratchMemory(Scratch::kAttention, sizeof(int32_t) * (first + blocks)));
  for (int b = 0; b < blocks; ++b) {
    const int64_t block = seq.blocks[first + b];
    WidenBlock<F>(SegmentOf(s, key_cache, block, g, F::kFormat), bs, hd, true,
                  reinterpret_cast<float*>(keys + segment * b));
    WidenBlock<F>(SegmentOf(s, value_cache, block, g, F::kFormat), bs, hd, false,
                  reinterpret_cast<float*>(values + segment * b));
    order[first + b] = b;
  }
  PackedAttention one = s;
  one.kv_heads = 1;
  one.num_blocks = blocks;
  PackedSequence widened = seq;
  widened.blocks = order;
  AttendSpan<F32Values>(one, p, keys, values, widened, 0, qs, count, span);
}

template <typename F>
void Attend(const PackedAttention& s, const AttentionParams& p, const float* q, const uint8_t* key_cache, const uint8_t* value_cache, const PackedSequence& seq, int g, int s0, int s1,
            float* out) {
  const int hd = s.head_dim, group = s.heads / s.kv_heads;
  const int count = (s1 - s0) * group;          // query j: token s0 + j / group, head g * group + j % group
  Query qs[kKvMaxQueries];
  for (int j = 0; j < count; ++j) {
    const size_t at = (static_cast<size_t>(seq.begin) + s0 + j / group) * s.heads * hd + (g * group + j % group) * hd;
    float sum = 0.f;
    for (int d = 0; d < hd; ++d) sum += q[at + d];
    const int64_t last = seq.past + s0 + j / group;
    qs[j] = {q + at, sum, FirstKey(p, last), last, out + at};
  }
  const int64_t lo = FirstKey(p, seq.past + s0), hi = seq.past + s1 - 1;
  const Span span{lo / s.block_size * s.block_size, lo, hi};
  // Every query reads the keys and values as the cache holds them, the call's own tokens too (stored
  // before any task attends): a prefill sees what the decodes after it will, as OpenVINO's operation
  // does. Many queries read a widened copy of the span.
  if (count > kQueryGroup || seq.count > 1)
    return AttendWidened<F>(s, p, key_cache, value_cache, seq, g, qs, count, span);
  AttendSpan<F>(s, p, key_cache, value_cache, seq, g, qs, count, span);
}

}  // namespace

void KILN_STORE_TOKEN(KvFormat f, const float* x, int hd, int bs, uint8_t* segment, int slot, bool keys) {
  if (f == KvFormat::kU8) return StoreU8(x, hd, bs, segment, slot, keys);
  if (f == KvFormat::kF16) StoreF16(x, hd, bs, segment, slot, keys);
}

void KILN_ATTEND_KV(KvFormat f, const PackedAttention& s, const AttentionParams& p, const float* q, const float* k,
                    const float* v, const uint8_t* key_cache, const uint8_t* value_cache, const PackedSequence& seq,
                    int g, int s0, int s1, float* out) {
  // k and v were stored before any task attends; every query reads them through the cache (Attend)
  (void)k;
  (void)v;
  if (f == KvFormat::kU8) return Attend<U8Codes>(s, p, q, key_cache, value_cache, seq, g, s0, s1, out);
  if (f == KvFormat::kF16) return Attend<F16Values>(s, p, q, key_cache, value_cache, seq, g, s0, s1, out);
}

}  // namespace kiln
