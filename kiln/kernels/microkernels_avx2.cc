// The avx2 level's micro-kernels (AVX2, FMA, F16C; build.py compiles this file with those flags
// alone). Also what the avx512 and avx512vnni levels run for the paths their own files leave alone:
// int16 and float activations on Q8_0.
#include <immintrin.h>

#include <cstring>

#include "driver.h"
#include "kernels.h"

namespace kiln {
namespace {

constexpr int kRowGroup = 4;    // rows that share one unpacking of a tile's codes (int8 activations)
constexpr int kHalfColumns = kTileColumns / 2;      // columns per 256-bit vector of floats

inline int32_t Word(const int8_t* p) {      // 4 activation bytes as one int32 (unaligned)
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 8 columns' half floats at byte `offset` of a tile-block, from column 8h
inline __m256 Halves(const uint8_t* blk, int offset, int h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + offset + h * kHalfColumns * kHalfBytes)));
}

// Row r's 16 sums (two vectors of 8 columns) into y, its `cols` real columns.
inline void StoreRow(__m256 lo, __m256 hi, float* y, int cols) {
  float out[kTileColumns];
  _mm256_storeu_ps(out, lo);
  _mm256_storeu_ps(out + kHalfColumns, hi);
  std::memcpy(y, out, sizeof(float) * cols);
}

// ---- activations --------------------------------------------------------------------------------

// The maximum of 8 lanes.
inline float Max8(__m256 v) {
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  return _mm_cvtss_f32(m4);
}

void QuantizeI8(const float* x, int k, int8_t* xq, float* dx, float* xs) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int b = 0; b < k / kBlock; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      sum = _mm256_add_ps(sum, v[i]);
    }
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1));
    const float a = Max8(amax);
    const __m256 inv = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    // int32 -> int16 -> int8 with saturation (values are within +-127); packs interleave lanes, so permute back
    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock), ordered);
    dx[b] = a / 127.0f;
    xs[b] = _mm_cvtss_f32(s4);
  }
}

void QuantizeI16(const float* x, int k, int16_t* xq, float* dx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int b = 0; b < k / kBlock; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float a = Max8(amax);
    const __m256 inv = _mm256_set1_ps(a > 0.0f ? 32767.0f / a : 0.0f);
    for (int i = 0; i < 4; i += 2) {
      // packs interleaves the 128-bit lanes: qwords 0, 2, 1, 3 put the 16 values back in order
      const __m256i q = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)),
                                           _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], inv)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock + 8 * i), _mm256_permute4x64_epi64(q, 0xD8));
    }
    dx[b] = a / 32767.0f;
  }
}

// ---- Q4_1, int8 activations ---------------------------------------------------------------------
// pmaddubsw sums two u8 x s8 products into int16: each is at most 15 * 127, so the eight products a
// block's 32 codes give per output fit int16 (8 * 2 * 1905 = 30480 < 32767) before one pmaddwd.
template <int R>
void Q4_1Rows(const Int8Rows& x, const uint8_t* tile, float* y, size_t ystride, int cols) {
  const int nb = x.k / kBlock;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {              // columns 8h .. 8h + 7
    __m256 acc[R], off[R];
    for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      __m256i lo[Q4_1::kGroups], hi[Q4_1::kGroups];         // the block's codes, low and high nibbles
      const uint8_t* blk = tile + static_cast<size_t>(b) * Q4_1::kBlockBytes;
      for (int i = 0; i < Q4_1::kGroups; ++i) {
        const __m256i v = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(blk + i * Q4_1::kGroupBytes + h * kHalfColumns * kWordBytes));
        lo[i] = _mm256_and_si256(v, low);
        hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      const __m256 d = Halves(blk, Q4_1::kScales, h), mn = Halves(blk, Q4_1::kMins, h);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = x.q + static_cast<size_t>(r) * x.k + b * kBlock;
        __m256i s16 = _mm256_setzero_si256();
        for (int i = 0; i < Q4_1::kGroups; ++i) {
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[i], _mm256_set1_epi32(Word(xb + Q4_1::kGroupRows * i))));
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(
              hi[i], _mm256_set1_epi32(Word(xb + Q4_1::kGroupRows * i + Q4_1::kHighRows))));
        }
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(x.scale[r * nb + b])), acc[r]);
        off[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x.sum[r * nb + b]), off[r]);
      }
    }
    const int valid = cols - kHalfColumns * h;
    for (int r = 0; r < R && valid > 0; ++r) {
      float out[kHalfColumns];
      _mm256_storeu_ps(out, _mm256_add_ps(acc[r], off[r]));
      std::memcpy(y + static_cast<size_t>(r) * ystride + kHalfColumns * h, out,
                  sizeof(float) * (valid < kHalfColumns ? valid : kHalfColumns));
    }
  }
}

// One row: both 8-column halves in one pass over a block, so each activation word is broadcast once
// (a row has no other rows to share the unpacked codes with).
void Q4_1OneRow(const Int8Rows& x, const uint8_t* tile, float* y, size_t /*ystride*/, int cols) {
  const int nb = x.k / kBlock;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), off0 = _mm256_setzero_ps(), off1 = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + static_cast<size_t>(b) * Q4_1::kBlockBytes;
    const int8_t* xb = x.q + b * kBlock;
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int i = 0; i < Q4_1::kGroups; ++i) {
      const uint8_t* group = blk + i * Q4_1::kGroupBytes;
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kHalfColumns * kWordBytes));
      const __m256i xl = _mm256_set1_epi32(Word(xb + Q4_1::kGroupRows * i));
      const __m256i xh = _mm256_set1_epi32(Word(xb + Q4_1::kGroupRows * i + Q4_1::kHighRows));
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_and_si256(v0, low), xl));
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low), xh));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_and_si256(v1, low), xl));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low), xh));
    }
    const __m256 scale = _mm256_set1_ps(x.scale[b]), sum = _mm256_set1_ps(x.sum[b]);
    const __m256 d0 = Halves(blk, Q4_1::kScales, 0), d1 = Halves(blk, Q4_1::kScales, 1);
    const __m256 m0 = Halves(blk, Q4_1::kMins, 0), m1 = Halves(blk, Q4_1::kMins, 1);
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s0, ones)), _mm256_mul_ps(d0, scale), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s1, ones)), _mm256_mul_ps(d1, scale), acc1);
    off0 = _mm256_fmadd_ps(m0, sum, off0);
    off1 = _mm256_fmadd_ps(m1, sum, off1);
  }
  StoreRow(_mm256_add_ps(acc0, off0), _mm256_add_ps(acc1, off1), y, cols);
}

struct Q4_1Int8 : OneTileMicro {
  RowGroups Groups(int) const { return {kRowGroup}; }
  void Run(const TileStep& s, const RowGroup& g, const Int8Rows& x, float* y, size_t ystride) const {
    using Fn = void (*)(const Int8Rows&, const uint8_t*, float*, size_t, int);
    static constexpr Fn kFns[] = {Q4_1OneRow, Q4_1Rows<2>, Q4_1Rows<3>, Q4_1Rows<4>};
    kFns[g.rows - 1](x, s.at, y, ystride, s.columns);
  }
};

// ---- Q8_0, int8 activations ---------------------------------------------------------------------
// pmaddubsw takes |x| (u8) times q with x's sign: two products of at most 127 * 127 fit int16. |x|
// and x's broadcast depend only on the activation, so both 8-column halves of the tile share them.
template <int R>
void Q8Rows(const Int8Rows& x, const uint8_t* tile, float* y, size_t ystride, int cols) {
  const int nb = x.k / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + static_cast<size_t>(b) * Q8_0::kBlockBytes;
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = x.q + static_cast<size_t>(r) * x.k + b * kBlock;
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      for (int g = 0; g < Q8_0::kGroups; ++g) {
        const uint8_t* group = blk + g * Q8_0::kGroupBytes;
        const __m256i bx = _mm256_set1_epi32(Word(xb + Q8_0::kGroupRows * g)), ax = _mm256_abs_epi8(bx);
        const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group));
        const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kHalfColumns * kWordBytes));
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(q0, bx)), ones));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(q1, bx)), ones));
      }
      const __m256 scale = _mm256_set1_ps(x.scale[r * nb + b]);
      const __m256 d0 = Halves(blk, Q8_0::kScales, 0), d1 = Halves(blk, Q8_0::kScales, 1);
      acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, scale), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, scale), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) StoreRow(acc[r][0], acc[r][1], y + static_cast<size_t>(r) * ystride, cols);
}

struct Q8Int8 : OneTileMicro {
  RowGroups Groups(int) const { return {kRowGroup}; }
  void Run(const TileStep& s, const RowGroup& g, const Int8Rows& x, float* y, size_t ystride) const {
    using Fn = void (*)(const Int8Rows&, const uint8_t*, float*, size_t, int);
    static constexpr Fn kFns[] = {Q8Rows<1>, Q8Rows<2>, Q8Rows<3>, Q8Rows<4>};
    kFns[g.rows - 1](x, s.at, y, ystride, s.columns);
  }
};

// ---- Q8_0, float activations (accuracy_level 0) -------------------------------------------------
// w = d·q is exact in float (an 11-bit half mantissa times an 8-bit code), and every path adds
// x[m, k]·w[k, n] into one sum per output, k in order: a row's result does not depend on which rows
// share the call. The vector path is an f32 GEMM over each tile's weights widened once per call into a
// [K][16] float panel, six rows at a time against it; where a CPU lacks VNNI this runs at about the
// speed int8 activations would (pmaddubsw's 16-bit sums need a second multiply), with float's accuracy.
constexpr int kFloatRows = 6;       // 6 rows x 16 columns: 12 accumulators, the two panel vectors, x
constexpr int kFewFloatRows = 2;    // up to here each group's codes are widened in registers, two tiles at a time

// A group's 64 bytes hold q[4g + r, j] at j*4 + r: per 128-bit lane one shuffle gathers each r's four
// columns, one permute joins the lanes' halves; the codes are widened to floats times the scales d.
struct Widened {
  __m256 w[4];     // w[r] = d * q[4g + r, 8h .. 8h + 7]
};

__attribute__((always_inline)) inline Widened WidenGroup(const uint8_t* bytes, __m256 d) {
  const __m256i by_r = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                        0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i v = _mm256_permutevar8x32_epi32(
      _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)), by_r),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  const __m128i by_row[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
  Widened out;
  for (int r = 0; r < 4; ++r) out.w[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(by_row[r])), d);
  return out;
}

// panel[kk * 16 + j] = d[j, kk / 32] * q[kk, j]: each group widened as the one- and two-row path
// widens it (WidenGroup), stored once for all the rows of the call.
void WidenTile(const uint8_t* tile, int nb, float* panel) {
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + static_cast<size_t>(b) * Q8_0::kBlockBytes;
    const __m256 d[2] = {Halves(blk, Q8_0::kScales, 0), Halves(blk, Q8_0::kScales, 1)};
    for (int g = 0; g < Q8_0::kGroups; ++g) {
      for (int h = 0; h < 2; ++h) {      // columns 8h .. 8h + 7
        const Widened wg = WidenGroup(blk + g * Q8_0::kGroupBytes + h * kHalfColumns * kWordBytes, d[h]);
        float* out = panel + static_cast<size_t>(b * kBlock + Q8_0::kGroupRows * g) * kTileColumns + kHalfColumns * h;
        for (int r = 0; r < 4; ++r) _mm256_storeu_ps(out + r * kTileColumns, wg.w[r]);
      }
    }
  }
}

// One row's two 8-column sums: lo += x * w0, hi += x * w1.
__attribute__((always_inline)) inline void RowFma(const float* x, __m256 w0, __m256 w1, __m256& lo, __m256& hi) {
  const __m256 a = _mm256_broadcast_ss(x);
  lo = _mm256_fmadd_ps(a, w0, lo);
  hi = _mm256_fmadd_ps(a, w1, hi);
}

// NOTE: the sums live in named registers (c0 .. c11, rows past R compiled out): GCC kept an array of
// them on the stack, storing all twelve every k (half the FMA rate).
template <int R>
void RowsTimesPanel(const float* x, int k, const float* panel, float* y, size_t ystride, int cols) {
  static_assert(R >= 1 && R <= kFloatRows, "six rows at most");
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0,
         c9 = c0, c10 = c0, c11 = c0;
  const float* xr[kFloatRows];
  for (int r = 0; r < kFloatRows; ++r) xr[r] = x + static_cast<size_t>(r < R ? r : 0) * k;
  for (int kk = 0; kk < k; ++kk) {
    const __m256 w0 = _mm256_loadu_ps(panel + static_cast<size_t>(kk) * kTileColumns);
    const __m256 w1 = _mm256_loadu_ps(panel + static_cast<size_t>(kk) * kTileColumns + kHalfColumns);
    RowFma(xr[0] + kk, w0, w1, c0, c1);
    if constexpr (R > 1) RowFma(xr[1] + kk, w0, w1, c2, c3);
    if constexpr (R > 2) RowFma(xr[2] + kk, w0, w1, c4, c5);
    if constexpr (R > 3) RowFma(xr[3] + kk, w0, w1, c6, c7);
    if constexpr (R > 4) RowFma(xr[4] + kk, w0, w1, c8, c9);
    if constexpr (R > 5) RowFma(xr[5] + kk, w0, w1, c10, c11);
  }
  const __m256 sums[2 * kFloatRows] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
  for (int r = 0; r < R; ++r) StoreRow(sums[2 * r], sums[2 * r + 1], y + static_cast<size_t>(r) * ystride, cols);
}

// acc += x[0..3] . w, k in order
__attribute__((always_inline)) inline __m256 AddFour(const Widened& g, const float* x, __m256 acc) {
  for (int r = 0; r < 4; ++r) acc = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r), g.w[r], acc);
  return acc;
}

// A group of a tile's codes (both 8-column halves) widened and times R rows' four activations: row
// 0's sums lo0 / hi0, row 1's lo1 / hi1.
template <int R>
__attribute__((always_inline)) inline void GroupTimesRows(const uint8_t* group, __m256 d0, __m256 d1, const float* x0,
                                                          const float* x1, __m256& lo0, __m256& hi0, __m256& lo1,
                                                          __m256& hi1) {
  const Widened w0 = WidenGroup(group, d0), w1 = WidenGroup(group + kHalfColumns * kWordBytes, d1);
  lo0 = AddFour(w0, x0, lo0);
  hi0 = AddFour(w1, x0, hi0);
  if constexpr (R > 1) {
    lo1 = AddFour(w0, x1, lo1);
    hi1 = AddFour(w1, x1, hi1);
  }
}

// One or two rows (decode): a panel would be widened for one use, so each group's codes are widened
// in registers and used at once, two tiles side by side (eight sums in flight hide the FMA latency).
// y for R (1 or 2) rows over tiles a and b (b may be a itself: its sums are then not stored).
template <int R>
void FewRowsTwoTiles(const float* x, int k, const uint8_t* ta, const uint8_t* tb, float* ya, float* yb,
                     size_t ystride, int cols_a, int cols_b) {
  static_assert(R == 1 || R == 2, "one or two rows");
  const int nb = k / kBlock;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;      // row 0: tile a / b, halves 0 / 1
  __m256 a2 = a0, a3 = a0, b2 = a0, b3 = a0;                       // row 1
  const float* x1 = x + (R > 1 ? k : 0);
  for (int blk_i = 0; blk_i < nb; ++blk_i) {
    const uint8_t* pa = ta + static_cast<size_t>(blk_i) * Q8_0::kBlockBytes;
    const uint8_t* pb = tb + static_cast<size_t>(blk_i) * Q8_0::kBlockBytes;
    const __m256 da0 = Halves(pa, Q8_0::kScales, 0), da1 = Halves(pa, Q8_0::kScales, 1);
    const __m256 db0 = Halves(pb, Q8_0::kScales, 0), db1 = Halves(pb, Q8_0::kScales, 1);
    for (int g = 0; g < Q8_0::kGroups; ++g) {
      const int kk = blk_i * kBlock + Q8_0::kGroupRows * g;
      GroupTimesRows<R>(pa + g * Q8_0::kGroupBytes, da0, da1, x + kk, x1 + kk, a0, a1, a2, a3);
      GroupTimesRows<R>(pb + g * Q8_0::kGroupBytes, db0, db1, x + kk, x1 + kk, b0, b1, b2, b3);
    }
  }
  const __m256 sums[2][2][2] = {{{a0, a1}, {a2, a3}}, {{b0, b1}, {b2, b3}}};     // [tile][row][half]
  float* ys[2] = {ya, yb};
  const int cols[2] = {cols_a, cols_b};
  for (int t = 0; t < (ta == tb ? 1 : 2); ++t)
    for (int r = 0; r < R; ++r) StoreRow(sums[t][r][0], sums[t][r][1], ys[t] + static_cast<size_t>(r) * ystride, cols[t]);
}

using PanelFn = void (*)(const float*, int, const float*, float*, size_t, int);

// Few rows: two tiles a step, all rows in one call; more: a widened panel per tile, rows in groups
// as even as six allows (32 = 6+6+5+5+5+5): a short last group would run its few sums at the FMA's
// latency, not its throughput.
struct Q8Float {
  float* panel = nullptr;
  int TilesPerStep(int rows) const { return rows <= kFewFloatRows ? 2 : 1; }
  RowGroups Groups(int rows) const { return rows <= kFewFloatRows ? RowGroups{rows} : RowGroups{kFloatRows, true}; }
  void Prepare(const TileStep& s) {
    if (s.rows <= kFewFloatRows) return;
    const int k = static_cast<int>(s.tile_bytes / Q8_0::kBlockBytes) * kBlock;
    panel = static_cast<float*>(ScratchMemory(Scratch::kPanel, sizeof(float) * k * kTileColumns));
    WidenTile(s.at, k / kBlock, panel);
  }
  void Run(const TileStep& s, const RowGroup& g, const FloatRows& x, float* y, size_t ystride) const {
    if (s.rows <= kFewFloatRows) {
      const uint8_t* partner = s.count > 1 ? s.at + s.tile_bytes : s.at;     // itself when none is left
      (g.rows == 1 ? FewRowsTwoTiles<1> : FewRowsTwoTiles<2>)(x.x, x.k, s.at, partner, y, y + kTileColumns,
                                                              ystride, s.Columns(0), s.Columns(s.count - 1));
      return;
    }
    static constexpr PanelFn kFns[] = {RowsTimesPanel<1>, RowsTimesPanel<2>, RowsTimesPanel<3>,
                                       RowsTimesPanel<4>, RowsTimesPanel<5>, RowsTimesPanel<6>};
    kFns[g.rows - 1](x.x, x.k, panel, y, ystride, s.columns);
  }
};

// ---- Q8_0, int16 activations (accuracy_level 2) -------------------------------------------------
// Q8_0 codes times activations quantized per block of 32 to int16 (scale amax/32767, 15 bits where
// int8 activations keep 7). Why: on AVX2 without VNNI, pmaddwd multiplies 16 int16 pairs per
// instruction at the FMA units' rate, twice the products of an f32 FMA, with no |x| / sign fix-ups
// (pmaddubsw needs both, and a second multiply to widen its 16-bit sums). The block's integer dot is
// exact (|x| <= 32767, |q| <= 127: 32 products stay below 2^31), so every path computes, per output,
// acc += float(dot_b) * (d[n, b] * dx[m, b]) with b in order: a row's result is bit for bit the same
// whichever path runs it and whichever rows share the call.
constexpr int kPairs = kBlock / 2;             // int16 pairs per block
constexpr int kPanelRows = 3;                  // rows per pass over a widened tile: 6 int + 6 float sums
constexpr int kWidenFromRows = 6;              // fewer rows widen each group in registers, two rows at a time

// The panel of one tile: per block, 16 pairs p of [16 columns][2] int16 = q[2p, j], q[2p + 1, j]
// (two vectors of eight columns), and the block's 16 scales as floats. A group's 64 bytes hold
// q[4g + r, j] at j*4 + r, so pair h of column j is the 16-bit word 2j + h of its eight-column half.
struct Panel {
  int16_t* codes;      // [nb][16 pairs][16 columns][2]
  float* scales;       // [nb][16]
};

void WidenTileI16(const uint8_t* tile, int nb, Panel* panel) {
  // per 128-bit lane: words 0, 2, 4, 6 (pair 0 of four columns) to the low 8 bytes, 1, 3, 5, 7 above
  const __m256i by_pair = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + static_cast<size_t>(b) * Q8_0::kBlockBytes;
    float* s = panel->scales + static_cast<size_t>(b) * kTileColumns;
    _mm256_storeu_ps(s, Halves(blk, Q8_0::kScales, 0));
    _mm256_storeu_ps(s + kHalfColumns, Halves(blk, Q8_0::kScales, 1));
    int16_t* out = panel->codes + static_cast<size_t>(b) * kPairs * 2 * kTileColumns;
    for (int g = 0; g < Q8_0::kGroups; ++g) {
      for (int half = 0; half < 2; ++half) {
        const __m256i v = _mm256_permute4x64_epi64(
            _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                    blk + g * Q8_0::kGroupBytes + half * kHalfColumns * kWordBytes)), by_pair),
            0xD8);       // qwords 0, 2, 1, 3: pair 0 of all eight columns, then pair 1
        for (int h = 0; h < 2; ++h) {
          const __m128i pairs = h == 0 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + ((2 * g + h) * 2 + half) * kTileColumns),
                              _mm256_cvtepi8_epi16(pairs));
        }
      }
    }
  }
}

inline int32_t PairWord(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline int64_t Word64(const int16_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// One row's two 8-column int32 sums: its pair of activations (at x) times the two vectors of pairs.
__attribute__((always_inline)) inline void PairsMadd(const int16_t* x, __m256i w0, __m256i w1, __m256i& lo, __m256i& hi) {
  const __m256i a = _mm256_set1_epi32(PairWord(x));
  lo = _mm256_add_epi32(_mm256_madd_epi16(a, w0), lo);
  hi = _mm256_add_epi32(_mm256_madd_epi16(a, w1), hi);
}

// A block's end for one row: its two vectors of int32 dots, times the scales d and the row's dx, fused
// into the float sums.
__attribute__((always_inline)) inline void BlockFma(__m256i dot_lo, __m256i dot_hi, __m256 d0, __m256 d1, float dx,
                                                    __m256& lo, __m256& hi) {
  const __m256 e = _mm256_set1_ps(dx);
  lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lo), _mm256_mul_ps(d0, e), lo);
  hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_hi), _mm256_mul_ps(d1, e), hi);
}

// R rows against a widened tile. NOTE: the sums are named registers (s0 .. s5 int, f0 .. f5 float),
// rows past R compiled out: an array of them is what GCC spills.
template <int R>
void RowsTimesPanelI16(const int16_t* xq, const float* dx, int k, const Panel& panel, float* y, size_t ystride,
                       int cols) {
  static_assert(R >= 1 && R <= kPanelRows, "three rows at most");
  const int nb = k / kBlock;
  const int16_t* x0 = xq;
  const int16_t* x1 = xq + (R > 1 ? k : 0);
  const int16_t* x2 = xq + (R > 2 ? 2 * k : 0);
  __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0;
  for (int b = 0; b < nb; ++b) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0;
    const int16_t* w = panel.codes + static_cast<size_t>(b) * kPairs * 2 * kTileColumns;
    const int base = b * kBlock;
#pragma GCC unroll 4
    for (int p = 0; p < kPairs; ++p) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 2 * kTileColumns));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 2 * kTileColumns + kTileColumns));
      PairsMadd(x0 + base + 2 * p, w0, w1, s0, s1);
      if constexpr (R > 1) PairsMadd(x1 + base + 2 * p, w0, w1, s2, s3);
      if constexpr (R > 2) PairsMadd(x2 + base + 2 * p, w0, w1, s4, s5);
    }
    const __m256 d0 = _mm256_loadu_ps(panel.scales + static_cast<size_t>(b) * kTileColumns);
    const __m256 d1 = _mm256_loadu_ps(panel.scales + static_cast<size_t>(b) * kTileColumns + kHalfColumns);
    BlockFma(s0, s1, d0, d1, dx[b], f0, f1);
    if constexpr (R > 1) BlockFma(s2, s3, d0, d1, dx[nb + b], f2, f3);
    if constexpr (R > 2) BlockFma(s4, s5, d0, d1, dx[2 * nb + b], f4, f5);
  }
  const __m256 sums[2 * kPanelRows] = {f0, f1, f2, f3, f4, f5};
  for (int r = 0; r < R; ++r) StoreRow(sums[2 * r], sums[2 * r + 1], y + static_cast<size_t>(r) * ystride, cols);
}

// A quarter of a group (four columns by four k, 16 bytes at q) widened to int16 and times R rows'
// four activations (xa, xb): row 0's sums a, row 1's b.
template <int R>
__attribute__((always_inline)) inline void QuarterMadd(const uint8_t* q, __m256i xa, __m256i xb, __m256i& a, __m256i& b) {
  const __m256i u = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  a = _mm256_add_epi32(_mm256_madd_epi16(u, xa), a);
  if constexpr (R > 1) b = _mm256_add_epi32(_mm256_madd_epi16(u, xb), b);
}

// One or two rows (decode): a widened panel would be used once, so each quarter of a group (four
// columns by four k) is widened in a register and multiplied at once by the row's four activations:
// pmaddwd leaves column c's two pair sums side by side, and one hadd per eight columns joins them,
// in the order 0, 1, 4, 5, 2, 3, 6, 7 (its 128-bit lanes); the scales are permuted to match and the
// sums back at the end. The block's dot and its fused multiply-add are the panel path's, bit for bit.
template <int R>
void FewRowsTileI16(const int16_t* xq, const float* dx, int k, const uint8_t* tile, float* y, size_t ystride, int cols) {
  static_assert(R == 1 || R == 2, "one or two rows");
  const int nb = k / kBlock;
  const __m256i lanes = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);      // its own inverse
  const int16_t* x1 = xq + (R > 1 ? k : 0);
  __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;          // [row][half]
  constexpr int kQuarter = kTileColumns;                                // bytes of four columns' codes
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + static_cast<size_t>(b) * Q8_0::kBlockBytes;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;      // row 0, quarters 0 .. 3
    __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0;                           // row 1
    for (int g = 0; g < Q8_0::kGroups; ++g) {
      const __m256i xa = _mm256_set1_epi64x(Word64(xq + b * kBlock + Q8_0::kGroupRows * g));
      const __m256i xb = _mm256_set1_epi64x(Word64(x1 + b * kBlock + Q8_0::kGroupRows * g));
      const uint8_t* q = blk + g * Q8_0::kGroupBytes;
      QuarterMadd<R>(q, xa, xb, a0, b0);
      QuarterMadd<R>(q + kQuarter, xa, xb, a1, b1);
      QuarterMadd<R>(q + 2 * kQuarter, xa, xb, a2, b2);
      QuarterMadd<R>(q + 3 * kQuarter, xa, xb, a3, b3);
    }
    const __m256 d0 = _mm256_permutevar8x32_ps(Halves(blk, Q8_0::kScales, 0), lanes);
    const __m256 d1 = _mm256_permutevar8x32_ps(Halves(blk, Q8_0::kScales, 1), lanes);
    BlockFma(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3), d0, d1, dx[b], f0, f1);
    if constexpr (R > 1) BlockFma(_mm256_hadd_epi32(b0, b1), _mm256_hadd_epi32(b2, b3), d0, d1, dx[nb + b], f2, f3);
  }
  const __m256 sums[4] = {f0, f1, f2, f3};
  for (int r = 0; r < R; ++r)
    StoreRow(_mm256_permutevar8x32_ps(sums[2 * r], lanes), _mm256_permutevar8x32_ps(sums[2 * r + 1], lanes),
             y + static_cast<size_t>(r) * ystride, cols);
}

// Fewer than six rows: two at a time, each group widened in registers; more: a widened panel per
// tile, three rows at a time against it.
struct Q8Int16 : OneTileMicro {
  Panel panel{nullptr, nullptr};
  RowGroups Groups(int rows) const { return {rows < kWidenFromRows ? 2 : kPanelRows}; }
  void Prepare(const TileStep& s) {
    if (s.rows < kWidenFromRows) return;
    const int nb = static_cast<int>(s.tile_bytes / Q8_0::kBlockBytes);
    panel.codes = static_cast<int16_t*>(ScratchMemory(Scratch::kPanel, sizeof(int16_t) * nb * kBlock * kTileColumns));
    panel.scales = static_cast<float*>(ScratchMemory(Scratch::kPanelScales, sizeof(float) * nb * kTileColumns));
    WidenTileI16(s.at, nb, &panel);
  }
  void Run(const TileStep& s, const RowGroup& g, const Int16Rows& x, float* y, size_t ystride) const {
    if (s.rows < kWidenFromRows) {
      (g.rows == 1 ? FewRowsTileI16<1> : FewRowsTileI16<2>)(x.q, x.scale, x.k, s.at, y, ystride, s.columns);
      return;
    }
    using Fn = void (*)(const int16_t*, const float*, int, const Panel&, float*, size_t, int);
    static constexpr Fn kFns[] = {RowsTimesPanelI16<1>, RowsTimesPanelI16<2>, RowsTimesPanelI16<3>};
    kFns[g.rows - 1](x.q, x.scale, x.k, panel, y, ystride, s.columns);
  }
};

}  // namespace

void Avx2Kernels(Kernels* k) {
  k->quantize_i8 = QuantizeI8;
  k->quantize_i16 = QuantizeI16;
  k->q4_1_i8 = Linear<Q4_1, Q4_1Int8, Int8Rows>;
  k->q8_0_i8 = Linear<Q8_0, Q8Int8, Int8Rows>;
  k->q8_0_i16 = Linear<Q8_0, Q8Int16, Int16Rows>;
  k->q8_0_f32 = Linear<Q8_0, Q8Float, FloatRows>;
}

}  // namespace kiln
