// kiln.MatMulQ8 at accuracy_level 2: Q8_0 codes times activations quantized per block of 32 to int16
// (scale amax/32767, 15 bits where int8 activations keep 7). Why: on AVX2 without VNNI, pmaddwd
// multiplies 16 int16 pairs per instruction at the FMA units' rate, twice the products of an f32 FMA,
// with no |x| / sign fix-ups (pmaddubsw needs both, and a second multiply to widen its 16-bit sums).
// The block's integer dot is exact (|x| <= 32767, |q| <= 127: 32 products stay below 2^31), so every
// path computes, per output, acc += float(dot_b) * (d[n, b] * dx[m, b]) with b in order: a row's
// result is bit for bit the same whichever path runs it and whichever rows share the call.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "q4min_kernel.h"

namespace kiln_q4 {

namespace {

constexpr int kPairs = kBlock / 2;             // int16 pairs per block
constexpr int kPanelRows = 3;                  // rows per pass over a widened tile: 6 int + 6 float sums
constexpr int kWidenFromRows = 6;              // fewer rows widen each group in registers, two rows at a time

inline float BlockScale(const uint8_t* blk, int j) {
  uint16_t d16;
  std::memcpy(&d16, blk + 512 + 2 * j, 2);
  return HalfToFloat(d16);
}

void TileScalarI16(const int16_t* xq, const float* dx, int rows, int k, const uint8_t* tile, float* y, int ystride,
                   int cols) {
  const int nb = k / kBlock;
  for (int m = 0; m < rows; ++m) {
    for (int j = 0; j < cols; ++j) {
      float acc = 0.0f;
      for (int b = 0; b < nb; ++b) {
        const uint8_t* blk = tile + static_cast<size_t>(b) * kTileBlockBytesQ8;
        const int16_t* x = xq + static_cast<size_t>(m) * k + b * kBlock;
        int32_t dot = 0;
        for (int g = 0; g < 8; ++g)
          for (int r = 0; r < 4; ++r) dot += static_cast<int8_t>(blk[g * 64 + j * 4 + r]) * x[4 * g + r];
        acc = std::fma(static_cast<float>(dot), BlockScale(blk, j) * dx[m * nb + b], acc);
      }
      y[static_cast<size_t>(m) * ystride + j] = acc;
    }
  }
}

// The panel of one tile: per block, 16 pairs p of [16 columns][2] int16 = q[2p, j], q[2p + 1, j]
// (two vectors of eight columns), and the block's 16 scales as floats. A group's 64 bytes hold
// q[4g + r, j] at j*4 + r, so pair h of column j is the 16-bit word 2j + h of its eight-column half.
struct Panel {
  std::vector<int16_t> codes;      // [nb][16 pairs][16 columns][2]
  std::vector<float> scales;       // [nb][16]
};

__attribute__((target("avx2,f16c")))
void WidenTileI16(const uint8_t* tile, int nb, Panel* panel) {
  // per 128-bit lane: words 0, 2, 4, 6 (pair 0 of four columns) to the low 8 bytes, 1, 3, 5, 7 above
  const __m256i by_pair = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + static_cast<size_t>(b) * kTileBlockBytesQ8;
    float* s = panel->scales.data() + static_cast<size_t>(b) * kTile;
    _mm256_storeu_ps(s, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 512))));
    _mm256_storeu_ps(s + 8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 528))));
    int16_t* out = panel->codes.data() + static_cast<size_t>(b) * kPairs * 2 * kTile;
    for (int g = 0; g < 8; ++g) {
      for (int half = 0; half < 2; ++half) {
        const __m256i v = _mm256_permute4x64_epi64(
            _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + g * 64 + half * 32)), by_pair),
            0xD8);       // qwords 0, 2, 1, 3: pair 0 of all eight columns, then pair 1
        for (int h = 0; h < 2; ++h) {
          const __m128i pairs = h == 0 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + ((2 * g + h) * 2 + half) * kTile),
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

// R rows against a widened tile. NOTE: the sums are named registers (s0 .. s5 int, f0 .. f5 float),
// rows past R compiled out: an array of them is what GCC spills.
template <int R>
__attribute__((target("avx2,fma")))
void RowsTimesPanelI16(const int16_t* xq, const float* dx, int k, const Panel& panel, float* y, int ystride,
                       int cols) {
  static_assert(R >= 1 && R <= kPanelRows, "three rows at most");
  const int nb = k / kBlock;
  const int16_t* x0 = xq;
  const int16_t* x1 = xq + (R > 1 ? k : 0);
  const int16_t* x2 = xq + (R > 2 ? 2 * k : 0);
  __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0;
  for (int b = 0; b < nb; ++b) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0;
    const int16_t* w = panel.codes.data() + static_cast<size_t>(b) * kPairs * 2 * kTile;
    const int base = b * kBlock;
#pragma GCC unroll 4
    for (int p = 0; p < kPairs; ++p) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 2 * kTile));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 2 * kTile + kTile));
      __m256i a = _mm256_set1_epi32(PairWord(x0 + base + 2 * p));
      s0 = _mm256_add_epi32(_mm256_madd_epi16(a, w0), s0);
      s1 = _mm256_add_epi32(_mm256_madd_epi16(a, w1), s1);
      if constexpr (R > 1) {
        a = _mm256_set1_epi32(PairWord(x1 + base + 2 * p));
        s2 = _mm256_add_epi32(_mm256_madd_epi16(a, w0), s2);
        s3 = _mm256_add_epi32(_mm256_madd_epi16(a, w1), s3);
      }
      if constexpr (R > 2) {
        a = _mm256_set1_epi32(PairWord(x2 + base + 2 * p));
        s4 = _mm256_add_epi32(_mm256_madd_epi16(a, w0), s4);
        s5 = _mm256_add_epi32(_mm256_madd_epi16(a, w1), s5);
      }
    }
    const __m256 d0 = _mm256_loadu_ps(panel.scales.data() + static_cast<size_t>(b) * kTile);
    const __m256 d1 = _mm256_loadu_ps(panel.scales.data() + static_cast<size_t>(b) * kTile + 8);
    __m256 e = _mm256_set1_ps(dx[b]);
    f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, e), f0);
    f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, e), f1);
    if constexpr (R > 1) {
      e = _mm256_set1_ps(dx[nb + b]);
      f2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2), _mm256_mul_ps(d0, e), f2);
      f3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s3), _mm256_mul_ps(d1, e), f3);
    }
    if constexpr (R > 2) {
      e = _mm256_set1_ps(dx[2 * nb + b]);
      f4 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s4), _mm256_mul_ps(d0, e), f4);
      f5 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s5), _mm256_mul_ps(d1, e), f5);
    }
  }
  const __m256 sums[2 * kPanelRows] = {f0, f1, f2, f3, f4, f5};
  for (int r = 0; r < R; ++r) {
    float out[kTile];
    _mm256_storeu_ps(out, sums[2 * r]);
    _mm256_storeu_ps(out + 8, sums[2 * r + 1]);
    std::memcpy(y + static_cast<size_t>(r) * ystride, out, sizeof(float) * cols);
  }
}

using PanelI16Fn = void (*)(const int16_t*, const float*, int, const Panel&, float*, int, int);

PanelI16Fn PanelI16Fn3(int rows) {
  static const PanelI16Fn fns[] = {RowsTimesPanelI16<1>, RowsTimesPanelI16<2>, RowsTimesPanelI16<3>};
  return fns[rows - 1];
}

// One or two rows (decode): a widened panel would be used once, so each quarter of a group (four
// columns by four k) is widened in a register and multiplied at once by the row's four activations:
// pmaddwd leaves column c's two pair sums side by side, and one hadd per eight columns joins them,
// in the order 0, 1, 4, 5, 2, 3, 6, 7 (its 128-bit lanes); the scales are permuted to match and the
// sums back at the end. The block's dot and its fused multiply-add are the panel path's, bit for bit.
template <int R>
__attribute__((target("avx2,fma,f16c")))
void FewRowsTileI16(const int16_t* xq, const float* dx, int k, const uint8_t* tile, float* y, int ystride, int cols) {
  static_assert(R == 1 || R == 2, "one or two rows");
  const int nb = k / kBlock;
  const __m256i lanes = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);      // its own inverse
  const int16_t* x1 = xq + (R > 1 ? k : 0);
  __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;          // [row][half]
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + static_cast<size_t>(b) * kTileBlockBytesQ8;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;      // row 0, quarters 0 .. 3
    __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0;                           // row 1
    for (int g = 0; g < 8; ++g) {
      __m256i u, v;
      const __m256i xa = _mm256_set1_epi64x(Word64(xq + b * kBlock + 4 * g));
      const __m256i xb = _mm256_set1_epi64x(Word64(x1 + b * kBlock + 4 * g));
      const uint8_t* q = blk + g * 64;
      u = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      a0 = _mm256_add_epi32(_mm256_madd_epi16(u, xa), a0);
      if constexpr (R > 1) b0 = _mm256_add_epi32(_mm256_madd_epi16(u, xb), b0);
      v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
      a1 = _mm256_add_epi32(_mm256_madd_epi16(v, xa), a1);
      if constexpr (R > 1) b1 = _mm256_add_epi32(_mm256_madd_epi16(v, xb), b1);
      u = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32)));
      a2 = _mm256_add_epi32(_mm256_madd_epi16(u, xa), a2);
      if constexpr (R > 1) b2 = _mm256_add_epi32(_mm256_madd_epi16(u, xb), b2);
      v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 48)));
      a3 = _mm256_add_epi32(_mm256_madd_epi16(v, xa), a3);
      if constexpr (R > 1) b3 = _mm256_add_epi32(_mm256_madd_epi16(v, xb), b3);
    }
    const __m256 d0 = _mm256_permutevar8x32_ps(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 512))), lanes);
    const __m256 d1 = _mm256_permutevar8x32_ps(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 528))), lanes);
    __m256 e = _mm256_set1_ps(dx[b]);
    f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(a0, a1)), _mm256_mul_ps(d0, e), f0);
    f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(a2, a3)), _mm256_mul_ps(d1, e), f1);
    if constexpr (R > 1) {
      e = _mm256_set1_ps(dx[nb + b]);
      f2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(b0, b1)), _mm256_mul_ps(d0, e), f2);
      f3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(b2, b3)), _mm256_mul_ps(d1, e), f3);
    }
  }
  const __m256 sums[4] = {f0, f1, f2, f3};
  for (int r = 0; r < R; ++r) {
    float out[kTile];
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(sums[2 * r], lanes));
    _mm256_storeu_ps(out + 8, _mm256_permutevar8x32_ps(sums[2 * r + 1], lanes));
    std::memcpy(y + static_cast<size_t>(r) * ystride, out, sizeof(float) * cols);
  }
}

inline int16_t RoundToInt16(float v) { return static_cast<int16_t>(_mm_cvtss_si32(_mm_set_ss(v))); }

void QuantizeRowI16Scalar(const float* x, int k, int16_t* xq, float* dx) {
  for (int b = 0; b < k / kBlock; ++b) {
    const float* v = x + b * kBlock;
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::fabs(v[i]) > amax ? std::fabs(v[i]) : amax;
    const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    for (int i = 0; i < kBlock; ++i) xq[b * kBlock + i] = RoundToInt16(v[i] * inv);
    dx[b] = amax / 32767.0f;
  }
}

__attribute__((target("avx2,fma")))
void QuantizeRowI16Avx2(const float* x, int k, int16_t* xq, float* dx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int b = 0; b < k / kBlock; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float a = _mm_cvtss_f32(m4);
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

}  // namespace

void QuantizeRowI16(Isa isa, const float* x, int k, int16_t* xq, float* dx) {
  if (isa == Isa::kScalar) QuantizeRowI16Scalar(x, k, xq, dx);
  else QuantizeRowI16Avx2(x, k, xq, dx);
}

void MatMulTilesQ8Int16(Isa isa, const int16_t* xq, const float* dx, int rows, int k, const uint8_t* w, int n,
                        int t0, int t1, float* y) {
  const int nb = k / kBlock;
  const size_t tile_bytes = static_cast<size_t>(nb) * kTileBlockBytesQ8;
  thread_local Panel panel;      // NOTE: per worker thread, reused: no allocation per call
  if (isa != Isa::kScalar && rows >= kWidenFromRows) {
    panel.codes.resize(static_cast<size_t>(k) * kTile);
    panel.scales.resize(static_cast<size_t>(nb) * kTile);
  }
  for (int t = t0; t < t1; ++t) {
    const uint8_t* tile = w + static_cast<size_t>(t) * tile_bytes;
    const int cols = n - t * kTile < kTile ? n - t * kTile : kTile;
    float* yt = y + static_cast<size_t>(t) * kTile;
    if (isa == Isa::kScalar) {
      TileScalarI16(xq, dx, rows, k, tile, yt, n, cols);
      continue;
    }
    if (rows < kWidenFromRows) {
      for (int m = 0; m < rows; m += 2)
        (rows - m == 1 ? FewRowsTileI16<1> : FewRowsTileI16<2>)(xq + static_cast<size_t>(m) * k,
                                                               dx + static_cast<size_t>(m) * nb, k, tile,
                                                               yt + static_cast<size_t>(m) * n, n, cols);
      continue;
    }
    WidenTileI16(tile, nb, &panel);
    for (int m = 0; m < rows; m += kPanelRows) {
      const int r = rows - m < kPanelRows ? rows - m : kPanelRows;
      PanelI16Fn3(r)(xq + static_cast<size_t>(m) * k, dx + static_cast<size_t>(m) * nb, k, panel,
                     yt + static_cast<size_t>(m) * n, n, cols);
    }
  }
}

}  // namespace kiln_q4
