// The avx512vnni level's decodes of kiln.PagedAttentionU8 (paged_kv_attention.h): a sequence's one
// new token, every query head of its kv head's group, over the u8 cache with integer dot products.
// build.py compiles this file with the avx512vnni level's flags; microkernels_avx512vnni.cc installs
// it (AttendDecodesOnVnni), and the amx level keeps it for what its tiles do not take (runs of few queries).
// A u8 prefill token is a decode of its own position here: the keys it sees are its sequence's up to it.
//
// Why: decoding many sequences over long contexts reads the whole cache every step, and widening each
// code to f32 before a multiply-add cost more than the cache's bytes take to arrive. The cache keeps
// its codes in 32-bit words of four (keys: 4 dimensions of a key; values: one dimension of 4 keys), so
// one vpdpbusd multiplies 16 words of codes by 4 signed bytes each and adds the 4 products per word:
//   scores   each query vector is split into two signed bytes per element, x = (high + low / 254) * step
//            (step = max |x| / 127): high * codes and low * codes, 4 dimensions per instruction, then
//            each key's scale and minimum as the f32 kernel applies them;
//   values   each block's weights (e^(score - largest) times the row's scale) are split the same way,
//            per block and query: high * codes and low * codes, 4 keys per instruction.
// The split keeps each query element and each weight to 1/64516 of its vector's largest (about 16
// bits, as the tiles' bf16 high and low parts do); the sums are exact integers until the one
// conversion per 16 keys (scores) or per block (values). The softmax runs in f32 as the blocks come
// (flash decoding). NOTE: like every per-level file it instantiates no std:: template.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "paged_kv_attention.h"
#include "u8s8.h"

namespace kiln {
namespace {

#include "attention_math.h"     // Lanes, Load, Total, ExpLanes (inside this anonymous namespace)

constexpr int kLanes = 16;

#include "kv_elements.h"        // U8Codes (its layout), Prefetch

constexpr int kMaxGroup = 8;            // query heads per kv head this kernel takes
constexpr int kMaxTaskHeads = 8;        // kv heads one pass over a sequence's blocks keeps
constexpr int kMaxBlock = 64;           // tokens per block (the op refuses more)
// How a task asks for its blocks ahead: each head's keys and values of the next block into L2, and of
// the block kFarBlocks on towards the last level. (Without asking, the cache's bytes arrived at half
// the rate a plain read of them gets: the products waited on each block's first lines.)
constexpr int kFarBlocks = 4;
constexpr float kLowSteps = 254.f;      // a low byte's unit: 1/254 of a high byte's
const Lanes kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
const Lanes kMinusInfinity = Lanes{} - INFINITY;

KILN_INLINE __m512 AsM512(Lanes x) {
  __m512 v;
  std::memcpy(&v, &x, sizeof v);
  return v;
}

KILN_INLINE Lanes AsLanes(__m512 v) {
  Lanes x;
  std::memcpy(&x, &v, sizeof x);
  return x;
}

// x[n] (n a multiple of 16, |x| <= amax) as high and low bytes, x = (high + low / 254) * step; returns
// step (0 where amax is 0: every byte 0).
float SplitBytes(const float* x, int n, float amax, int8_t* high, int8_t* low) {
  if (!(amax > 0.f)) {
    std::memset(high, 0, n);
    std::memset(low, 0, n);
    return 0.f;
  }
  const __m512 steps = _mm512_set1_ps(127.f / amax);
  for (int i = 0; i < n; i += kLanes) {
    const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(x + i), steps);
    const __m512 h = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 l = _mm512_mul_ps(_mm512_sub_ps(t, h), _mm512_set1_ps(kLowSteps));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(high + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(h)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(low + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(l)));
  }
  return amax / 127.f;
}

// One query vector of the token: its bytes (4 dimensions per word), and where its output goes.
struct DecodeQuery {
  alignas(64) int8_t high[kMaxHeadDim];
  alignas(64) int8_t low[kMaxHeadDim];
  float step;     // a high byte's unit
  float sum;      // of x in f32: a key's minimum times it is that key's rows' share of the score
  float* out;
};

// A block's weights for one query: the bytes of 4 consecutive keys per word.
struct BlockWeights {
  alignas(64) int8_t high[kMaxBlock];
  alignas(64) int8_t low[kMaxBlock];
  float step;
};

// The integer sums high and low as the f32 they stand for, times step.
KILN_INLINE __m512 Combine(__m512i high, __m512i low, float step) {
  const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), _mm512_set1_ps(1.f / kLowSteps), _mm512_cvtepi32_ps(high));
  return _mm512_mul_ps(sum, _mm512_set1_ps(step));
}

// Codes times J queries over the head's dimensions for G groups of 16 keys from slot h16: code sums
// in f32 (before each key's scale and minimum), into dots[j][g].
template <int J, int G>
KILN_INLINE void CodeDots(const uint8_t* codes, int bs, int hd, int h16, const DecodeQuery* qs, __m512* dots) {
  __m512i high[J][G], low[J][G];
  for (int j = 0; j < J; ++j)
    for (int g = 0; g < G; ++g) high[j][g] = low[j][g] = _mm512_setzero_si512();
  for (int quad = 0; quad < hd / 4; ++quad) {
    __m512i k[G];
    for (int g = 0; g < G; ++g)
      k[g] = _mm512_loadu_si512(codes + (static_cast<size_t>(quad) * bs + h16 + g * kLanes) * 4);
    for (int j = 0; j < J; ++j) {
      const __m512i qh = _mm512_set1_epi32(u8s8::Word(qs[j].high + 4 * quad));
      const __m512i ql = _mm512_set1_epi32(u8s8::Word(qs[j].low + 4 * quad));
      for (int g = 0; g < G; ++g) {
        high[j][g] = _mm512_dpbusd_epi32(high[j][g], k[g], qh);
        low[j][g] = _mm512_dpbusd_epi32(low[j][g], k[g], ql);
      }
    }
  }
  for (int j = 0; j < J; ++j)
    for (int g = 0; g < G; ++g) dots[j * G + g] = Combine(high[j][g], low[j][g], qs[j].step);
}

// The running softmax of J query vectors (flash decoding), as paged_kv_attention.cc keeps it.
template <int J>
struct Running {
  float top[J];
  Lanes total[J], minimum_share[J];
  Lanes acc[J][kMaxHeadDim / kLanes];
};

template <int J>
class Decode {
 public:
  void Start(const PackedAttention& s, const AttentionParams& p, const DecodeQuery* qs, int64_t first, int64_t last) {
    s_ = &s;
    p_ = &p;
    qs_ = qs;
    first_ = first;
    last_ = last;
    for (int j = 0; j < J; ++j) {
      run_.top[j] = -INFINITY;
      run_.total[j] = run_.minimum_share[j] = Lanes{};
      for (int c = 0; c < s.head_dim / kLanes; ++c) run_.acc[j][c] = Lanes{};
    }
  }

  // Block keys [b0, b0 + bs) into the running sums.
  void Take(const Segment& keys, const Segment& values, int64_t b0) {
    const int bs = s_->block_size;
    const int i0 = b0 < first_ ? static_cast<int>(first_ - b0) : 0;
    const int i1 = static_cast<int>(last_ - b0 + 1 < bs ? last_ - b0 + 1 : bs);
    alignas(64) float scores[J][kMaxBlock];
    Scores(keys, b0, i0, i1, scores);
    BlockWeights w[J];
    for (int j = 0; j < J; ++j) Weigh(j, values, i0, i1, scores[j], w[j]);
    AddValues(values, i0, i1, w);
  }

  void Finish() const {
    for (int j = 0; j < J; ++j) {
      const float inverse = 1.f / Total(run_.total[j]), minimum = Total(run_.minimum_share[j]);
      for (int c = 0; c < s_->head_dim / kLanes; ++c) {
        const Lanes v = (run_.acc[j][c] + minimum) * inverse;
        std::memcpy(qs_[j].out + c * kLanes, &v, sizeof v);
      }
    }
  }

 private:
  // The scores of slots [i0, i1) (16 at a time; -inf elsewhere and where the token sees no key).
  void Scores(const Segment& keys, int64_t b0, int i0, int i1, float (*scores)[kMaxBlock]) const {
    const int bs = s_->block_size, hd = s_->head_dim;
    for (int h16 = 0; h16 < bs; h16 += kLanes) {
      if (h16 >= i1 || h16 + kLanes <= i0) {
        for (int j = 0; j < J; ++j) std::memcpy(scores[j] + h16, &kMinusInfinity, sizeof(Lanes));
        continue;
      }
      const bool pair = J <= 4 && h16 + 2 * kLanes <= bs && h16 + kLanes < i1;   // two groups: 2J chains per pass
      __m512 dots[J * 2];
      if (pair)
        CodeDots<J, 2>(keys.codes, bs, hd, h16, qs_, dots);
      else
        CodeDots<J, 1>(keys.codes, bs, hd, h16, qs_, dots);
      for (int g = 0; g < (pair ? 2 : 1); ++g)
        for (int j = 0; j < J; ++j)
          ToScores(keys, b0, h16 + g * kLanes, AsLanes(dots[pair ? j * 2 + g : j]), qs_[j], scores[j]);
      if (pair) h16 += kLanes;
    }
  }

  // 16 code sums of one query into scores: the keys' scale and minimum, the score's factor and softcap,
  // -inf where the token does not see the key.
  void ToScores(const Segment& keys, int64_t b0, int h16, Lanes dot, const DecodeQuery& q, float* scores) const {
    Lanes x = (dot * Load(keys.scale + h16) + Load(keys.minimum + h16) * q.sum) * p_->scale;
    if (p_->softcap > 0.f)
      for (int i = 0; i < kLanes; ++i) x[i] = p_->softcap * std::tanh(x[i] / p_->softcap);
    const Lanes position = kIota + static_cast<float>(b0 + h16);      // exact in float below 2^24
    x = (position >= static_cast<float>(first_)) & (position <= static_cast<float>(last_)) ? x : kMinusInfinity;
    std::memcpy(scores + h16, &x, sizeof x);
  }

  // Query j's weights for the block's slots [i0, i1): the running largest, e^(score - largest) into the
  // total, each row's minimum into the share, the weights times the rows' scale split into bytes.
  void Weigh(int j, const Segment& values, int i0, int i1, const float* scores, BlockWeights& w) {
    const int bs = s_->block_size;
    Lanes most = kMinusInfinity;
    for (int h16 = 0; h16 < bs; h16 += kLanes) {
      const Lanes x = Load(scores + h16);
      most = x > most ? x : most;
    }
    const float block_top = _mm512_reduce_max_ps(AsM512(most));
    if (block_top > run_.top[j]) {                                // the sums so far, scaled to the new largest
      const float rescale = std::exp(run_.top[j] - block_top);    // 0 when nothing was seen before
      run_.top[j] = block_top;
      run_.total[j] *= rescale;
      run_.minimum_share[j] *= rescale;
      for (int c = 0; c < s_->head_dim / kLanes; ++c) run_.acc[j][c] *= rescale;
    }
    alignas(64) float weighted[kMaxBlock];
    Lanes largest = Lanes{};
    const Lanes top = Lanes{} + run_.top[j];
    for (int h16 = 0; h16 < bs; h16 += kLanes) {
      const Lanes x = Load(scores + h16);
      const Lanes slot = kIota + static_cast<float>(h16);
      const auto seen = (x > kMinusInfinity) & (slot >= static_cast<float>(i0)) & (slot < static_cast<float>(i1));
      const Lanes e = seen ? ExpLanes(x - top) : Lanes{};
      run_.total[j] += e;
      // NOTE: selected, not multiplied: an unwritten slot's scale or minimum may be any bits
      run_.minimum_share[j] += seen ? e * Load(values.minimum + h16) : Lanes{};
      const Lanes weight = seen ? e * Load(values.scale + h16) : Lanes{};
      largest = weight > largest ? weight : largest;
      std::memcpy(weighted + h16, &weight, sizeof weight);
    }
    w.step = SplitBytes(weighted, bs, _mm512_reduce_max_ps(AsM512(largest)), w.high, w.low);
  }

  // The weighted values of the block's slots [i0, i1) into the running sums, 4 keys per word.
  void AddValues(const Segment& values, int i0, int i1, const BlockWeights* w) {
    const int hd = s_->head_dim, q0 = i0 / 4, q1 = (i1 + 3) / 4;
    for (int c = 0; c < hd / kLanes; ++c) {
      __m512i high[J], low[J];
      for (int j = 0; j < J; ++j) high[j] = low[j] = _mm512_setzero_si512();
      for (int quad = q0; quad < q1; ++quad) {
        const __m512i v = _mm512_loadu_si512(values.codes + (static_cast<size_t>(quad) * hd + c * kLanes) * 4);
        for (int j = 0; j < J; ++j) {
          high[j] = _mm512_dpbusd_epi32(high[j], v, _mm512_set1_epi32(u8s8::Word(w[j].high + 4 * quad)));
          low[j] = _mm512_dpbusd_epi32(low[j], v, _mm512_set1_epi32(u8s8::Word(w[j].low + 4 * quad)));
        }
      }
      for (int j = 0; j < J; ++j) run_.acc[j][c] += AsLanes(Combine(high[j], low[j], w[j].step));
    }
  }

  const PackedAttention* s_;
  const AttentionParams* p_;
  const DecodeQuery* qs_;
  int64_t first_, last_;
  Running<J> run_;
};

// Query vector j of kv head g's group (token `row` of the call), split into bytes.
void SplitQuery(const PackedAttention& s, const float* q, int row, int g, int j, float* out, DecodeQuery& dq) {
  const int group = s.heads / s.kv_heads, hd = s.head_dim;
  const size_t at = static_cast<size_t>(row) * s.heads * hd + static_cast<size_t>(g * group + j) * hd;
  __m512 sum = _mm512_setzero_ps(), amax = _mm512_setzero_ps();
  for (int d = 0; d < hd; d += kLanes) {
    const __m512 x = _mm512_loadu_ps(q + at + d);
    sum = _mm512_add_ps(sum, x);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(x));
  }
  dq.sum = _mm512_reduce_add_ps(sum);
  dq.step = SplitBytes(q + at, hd, _mm512_reduce_max_ps(amax), dq.high, dq.low);
  dq.out = out + at;
}

// The sequence's new token over kv heads [g0, g1) (at most kMaxTaskHeads): block by block, and in each
// block head by head (a block's heads lie side by side in the cache), asking ahead as it goes.
template <int J>
void AttendHeads(const PackedAttention& s, const AttentionParams& p, const float* q, const uint8_t* key_cache,
                 const uint8_t* value_cache, const PackedSequence& seq, int g0, int g1, float* out) {
  const int bs = s.block_size, heads = g1 - g0;
  const int64_t last = seq.past;
  const int64_t first = p.window > 0 && last - p.window + 1 > 0 ? last - p.window + 1 : 0;
  const size_t segment = SegmentBytes(s.head_dim, bs, KvFormat::kU8);
  DecodeQuery qs[kMaxTaskHeads][J];
  Decode<J> decode[kMaxTaskHeads];
  for (int h = 0; h < heads; ++h) {
    for (int j = 0; j < J; ++j) SplitQuery(s, q, seq.begin, g0 + h, j, out, qs[h][j]);
    decode[h].Start(s, p, qs[h], first, last);
  }
  // NOTE: asked for in the loop itself: the same asking in a lambda compiled to no prefetch at all (GCC 12)
  const auto block_at = [&](int64_t position) { return position <= last ? seq.blocks[position / bs] : -1; };
  for (int64_t b0 = first / bs * bs; b0 <= last; b0 += bs) {
    const int64_t block = seq.blocks[b0 / bs], next = block_at(b0 + bs), far = block_at(b0 + kFarBlocks * bs);
    for (int h = 0; h < heads; ++h) {
      if (far >= 0) {
        Prefetch<1>(SegmentOf(s, key_cache, far, g0 + h, KvFormat::kU8).codes, segment);
        Prefetch<1>(SegmentOf(s, value_cache, far, g0 + h, KvFormat::kU8).codes, segment);
      }
      if (next >= 0) {
        Prefetch<2>(SegmentOf(s, key_cache, next, g0 + h, KvFormat::kU8).codes, segment);
        Prefetch<2>(SegmentOf(s, value_cache, next, g0 + h, KvFormat::kU8).codes, segment);
      }
      decode[h].Take(SegmentOf(s, key_cache, block, g0 + h, KvFormat::kU8),
                     SegmentOf(s, value_cache, block, g0 + h, KvFormat::kU8), b0);
    }
  }
  for (int h = 0; h < heads; ++h) decode[h].Finish();
}

AttendKvFn vector_attend = nullptr;

// A decode of kv heads [g0, g1) (paged_kv_attention.h's KvDecodeFn).
void DecodeKvVnni(const PackedAttention& s, const AttentionParams& p, const float* q, const uint8_t* key_cache,
                  const uint8_t* value_cache, const PackedSequence& seq, int g0, int g1, float* out) {
  using Fn = void (*)(const PackedAttention&, const AttentionParams&, const float*, const uint8_t*, const uint8_t*,
                      const PackedSequence&, int, int, float*);
  static constexpr Fn kByGroup[] = {nullptr, AttendHeads<1>, AttendHeads<2>, AttendHeads<3>, AttendHeads<4>,
                                    AttendHeads<5>, AttendHeads<6>, AttendHeads<7>, AttendHeads<8>};
  static_assert(sizeof(kByGroup) / sizeof(kByGroup[0]) == kMaxGroup + 1, "a copy per group size");
  if (s.heads / s.kv_heads > kMaxGroup) {       // wider groups: the vector kernel, a head at a time
    for (int g = g0; g < g1; ++g)
      vector_attend(KvFormat::kU8, s, p, q, nullptr, nullptr, key_cache, value_cache, seq, g, 0, 1, out);
    return;
  }
  for (int h0 = g0; h0 < g1; h0 += kMaxTaskHeads)
    kByGroup[s.heads / s.kv_heads](s, p, q, key_cache, value_cache, seq, h0, h0 + kMaxTaskHeads < g1 ? h0 + kMaxTaskHeads : g1, out);
}

// One kv head's task: a u8 cache's tokens here, each a decode of its own position (the call stored them
// all first); an f16 cache on the level's vector kernel.
void AttendKvVnni(KvFormat f, const PackedAttention& s, const AttentionParams& p, const float* q, const float* k,
                  const float* v, const uint8_t* key_cache, const uint8_t* value_cache, const PackedSequence& seq,
                  int g, int s0, int s1, float* out) {
  if (f != KvFormat::kU8) return vector_attend(f, s, p, q, k, v, key_cache, value_cache, seq, g, s0, s1, out);
  for (int t = s0; t < s1; ++t) {
    const PackedSequence token{seq.past + t, seq.begin + t, 1, seq.blocks, seq.num_blocks};
    DecodeKvVnni(s, p, q, key_cache, value_cache, token, g, g + 1, out);
  }
}

}  // namespace

void AttendDecodesOnVnni(Kernels* k) {
  vector_attend = k->attend_kv;
  k->attend_kv = AttendKvVnni;
  k->decode_kv = DecodeKvVnni;
}

}  // namespace kiln
