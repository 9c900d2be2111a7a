// kiln.MatMulQ8's arithmetic: 8-bit codes with a half-float scale per block of 32 (Q8_0), int8
// activations per block (q4min_kernel.h has the layout). Why a kernel of kiln's own for an 8-bit
// table: the LM head is a third of a SmolLM2 decode step's weight bytes, and ONNX Runtime's 8-bit
// MatMulNBits read it at about half the bandwidth this loop does (measured in the op's docstring).
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "q4min_kernel.h"

namespace kiln_q4 {

namespace {

constexpr int kRowGroup = 4;

inline int32_t Word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void TileScalar(const int8_t* xq, const float* dx, int rows, int k, const uint8_t* tile, float* y, int ystride,
                int cols) {
  const int nb = k / kBlock;
  for (int m = 0; m < rows; ++m) {
    for (int j = 0; j < cols; ++j) {
      float acc = 0.0f;
      for (int b = 0; b < nb; ++b) {
        const uint8_t* blk = tile + static_cast<size_t>(b) * kTileBlockBytesQ8;
        const int8_t* x = xq + static_cast<size_t>(m) * k + b * kBlock;
        int32_t dot = 0;
        for (int g = 0; g < 8; ++g)
          for (int r = 0; r < 4; ++r) dot += static_cast<int8_t>(blk[g * 64 + j * 4 + r]) * x[4 * g + r];
        uint16_t d16;
        std::memcpy(&d16, blk + 512 + 2 * j, 2);
        acc += static_cast<float>(dot) * (HalfToFloat(d16) * dx[m * nb + b]);
      }
      y[static_cast<size_t>(m) * ystride + j] = acc;
    }
  }
}

// pmaddubsw takes |x| (u8) times q with x's sign: two products of at most 127 * 127 fit int16. |x|
// and x's broadcast depend only on the activation, so both 8-column halves of the tile share them.
template <int R>
__attribute__((target("avx2,fma,f16c")))
void TileAvx2(const int8_t* xq, const float* dx, int k, const uint8_t* tile, float* y, int ystride, int cols) {
  const int nb = k / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + static_cast<size_t>(b) * kTileBlockBytesQ8;
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + static_cast<size_t>(r) * k + b * kBlock;
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        const __m256i bx = _mm256_set1_epi32(Word(x + 4 * g)), ax = _mm256_abs_epi8(bx);
        const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + g * 64));
        const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + g * 64 + 32));
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(q0, bx)), ones));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(q1, bx)), ones));
      }
      const __m256 scale = _mm256_set1_ps(dx[r * nb + b]);
      const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 512)));
      const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 528)));
      acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, scale), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, scale), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[kTile];
    _mm256_storeu_ps(out, acc[r][0]);
    _mm256_storeu_ps(out + 8, acc[r][1]);
    std::memcpy(y + static_cast<size_t>(r) * ystride, out, sizeof(float) * cols);
  }
}

// vpdpbusd takes u8 x s8: the codes go in offset by 128 (q ^ 0x80), and 128 * sum(xq) comes off.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
void TileAvx512(const int8_t* xq, const float* dx, const int32_t* xqsum, int k, const uint8_t* tile, float* y,
                int ystride, int cols) {
  const int nb = k / kBlock;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + static_cast<size_t>(b) * kTileBlockBytesQ8;
    __m512i u[8];
    for (int g = 0; g < 8; ++g) u[g] = _mm512_xor_si512(_mm512_loadu_si512(blk + g * 64), flip);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 512)));
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + static_cast<size_t>(r) * k + b * kBlock;
      __m512i s0 = _mm512_set1_epi32(-128 * xqsum[r * nb + b]), s1 = _mm512_setzero_si512();
      for (int g = 0; g < 8; g += 2) {
        s0 = _mm512_dpbusd_epi32(s0, u[g], _mm512_set1_epi32(Word(x + 4 * g)));
        s1 = _mm512_dpbusd_epi32(s1, u[g + 1], _mm512_set1_epi32(Word(x + 4 * g + 4)));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
    }
  }
  const __mmask16 mask = cols >= kTile ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + static_cast<size_t>(r) * ystride, mask, acc[r]);
}


using Avx512Tile = void (*)(const int8_t*, const float*, const int32_t*, int, const uint8_t*, float*, int, int);
using Avx2Tile = void (*)(const int8_t*, const float*, int, const uint8_t*, float*, int, int);

Avx512Tile Avx512Fn(int rows) {
  static const Avx512Tile fns[] = {TileAvx512<1>, TileAvx512<2>, TileAvx512<3>, TileAvx512<4>};
  return fns[rows - 1];
}

Avx2Tile Avx2Fn(int rows) {
  static const Avx2Tile fns[] = {TileAvx2<1>, TileAvx2<2>, TileAvx2<3>, TileAvx2<4>};
  return fns[rows - 1];
}

}  // namespace

void MatMulTilesQ8(Isa isa, const int8_t* xq, const float* dx, const int32_t* xqsum, int rows, int k,
                   const uint8_t* w, int n, int t0, int t1, float* y) {
  const int nb = k / kBlock;
  const size_t tile_bytes = static_cast<size_t>(nb) * kTileBlockBytesQ8;
  for (int t = t0; t < t1; ++t) {
    const uint8_t* tile = w + static_cast<size_t>(t) * tile_bytes;
    const int cols = n - t * kTile < kTile ? n - t * kTile : kTile;
    for (int m = 0; m < rows; m += kRowGroup) {
      const int r = rows - m < kRowGroup ? rows - m : kRowGroup;
      const int8_t* xm = xq + static_cast<size_t>(m) * k;
      float* ym = y + static_cast<size_t>(m) * n + t * kTile;
      if (isa == Isa::kAvx512Vnni) Avx512Fn(r)(xm, dx + m * nb, xqsum + m * nb, k, tile, ym, n, cols);
      else if (isa == Isa::kAvx2) Avx2Fn(r)(xm, dx + m * nb, k, tile, ym, n, cols);
      else TileScalar(xm, dx + m * nb, r, k, tile, ym, n, cols);
    }
  }
}

namespace {

// ---- float activations (accuracy_level 0) -------------------------------------------------------
// w = d·q is exact in float (an 11-bit half mantissa times an 8-bit code), and every path adds
// x[m, k]·w[k, n] into one sum per output, k in order: a row's result does not depend on which rows
// share the call. The vector path is an f32 GEMM over each tile's weights widened once per call into a
// [K][16] float panel, six rows at a time against it; where a CPU lacks VNNI this runs at about the
// speed int8 activations would (pmaddubsw's 16-bit sums need a second multiply), with float's accuracy.
constexpr int kFloatRows = 6;       // 6 rows x 16 columns: 12 accumulators, the two panel vectors, x

void TileFloatScalar(const float* x, int rows, int k, const uint8_t* tile, float* y, int ystride, int cols) {
  const int nb = k / kBlock;
  for (int m = 0; m < rows; ++m) {
    for (int j = 0; j < cols; ++j) {
      float acc = 0.0f;
      for (int b = 0; b < nb; ++b) {
        const uint8_t* blk = tile + static_cast<size_t>(b) * kTileBlockBytesQ8;
        uint16_t d16;
        std::memcpy(&d16, blk + 512 + 2 * j, 2);
        const float d = HalfToFloat(d16);
        for (int g = 0; g < 8; ++g)
          for (int r = 0; r < 4; ++r)
            acc += x[static_cast<size_t>(m) * k + b * kBlock + 4 * g + r] * (d * static_cast<int8_t>(blk[g * 64 + j * 4 + r]));
      }
      y[static_cast<size_t>(m) * ystride + j] = acc;
    }
  }
}

// A group's 64 bytes hold q[4g + r, j] at j*4 + r: per 128-bit lane one shuffle gathers each r's four
// columns, one permute joins the lanes' halves; the codes are widened to floats times the scales d.
struct Widened {
  __m256 w[4];     // w[r] = d * q[4g + r, 8h .. 8h + 7]
};

__attribute__((target("avx2,fma,f16c"), always_inline))
inline Widened WidenGroup(const uint8_t* bytes, __m256 d) {
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
__attribute__((target("avx2,fma,f16c")))
void WidenTileAvx2(const uint8_t* tile, int nb, float* panel) {
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + static_cast<size_t>(b) * kTileBlockBytesQ8;
    const __m256 d[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 512))),
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 528)))};
    for (int g = 0; g < 8; ++g) {
      for (int h = 0; h < 2; ++h) {      // columns 8h .. 8h + 7
        const Widened wg = WidenGroup(blk + g * 64 + h * 32, d[h]);
        float* out = panel + static_cast<size_t>(b * kBlock + 4 * g) * kTile + 8 * h;
        for (int r = 0; r < 4; ++r) _mm256_storeu_ps(out + r * kTile, wg.w[r]);
      }
    }
  }
}

// NOTE: the sums live in named registers (c0 .. c11, rows past R compiled out): GCC kept an array of
// them on the stack, storing all twelve every k (half the FMA rate).
template <int R>
__attribute__((target("avx2,fma")))
void RowsTimesPanelAvx2(const float* x, int k, const float* panel, float* y, int ystride, int cols) {
  static_assert(R >= 1 && R <= kFloatRows, "six rows at most");
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0,
         c9 = c0, c10 = c0, c11 = c0;
  const float* xr[kFloatRows];
  for (int r = 0; r < kFloatRows; ++r) xr[r] = x + static_cast<size_t>(r < R ? r : 0) * k;
  for (int kk = 0; kk < k; ++kk) {
    const __m256 w0 = _mm256_loadu_ps(panel + static_cast<size_t>(kk) * kTile);
    const __m256 w1 = _mm256_loadu_ps(panel + static_cast<size_t>(kk) * kTile + 8);
    __m256 a = _mm256_broadcast_ss(xr[0] + kk);
    c0 = _mm256_fmadd_ps(a, w0, c0);
    c1 = _mm256_fmadd_ps(a, w1, c1);
    if constexpr (R > 1) {
      a = _mm256_broadcast_ss(xr[1] + kk);
      c2 = _mm256_fmadd_ps(a, w0, c2);
      c3 = _mm256_fmadd_ps(a, w1, c3);
    }
    if constexpr (R > 2) {
      a = _mm256_broadcast_ss(xr[2] + kk);
      c4 = _mm256_fmadd_ps(a, w0, c4);
      c5 = _mm256_fmadd_ps(a, w1, c5);
    }
    if constexpr (R > 3) {
      a = _mm256_broadcast_ss(xr[3] + kk);
      c6 = _mm256_fmadd_ps(a, w0, c6);
      c7 = _mm256_fmadd_ps(a, w1, c7);
    }
    if constexpr (R > 4) {
      a = _mm256_broadcast_ss(xr[4] + kk);
      c8 = _mm256_fmadd_ps(a, w0, c8);
      c9 = _mm256_fmadd_ps(a, w1, c9);
    }
    if constexpr (R > 5) {
      a = _mm256_broadcast_ss(xr[5] + kk);
      c10 = _mm256_fmadd_ps(a, w0, c10);
      c11 = _mm256_fmadd_ps(a, w1, c11);
    }
  }
  const __m256 sums[2 * kFloatRows] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
  for (int r = 0; r < R; ++r) {
    float out[kTile];
    _mm256_storeu_ps(out, sums[2 * r]);
    _mm256_storeu_ps(out + 8, sums[2 * r + 1]);
    std::memcpy(y + static_cast<size_t>(r) * ystride, out, sizeof(float) * cols);
  }
}

// acc += x[0..3] . w, k in order
__attribute__((target("avx2,fma"), always_inline))
inline __m256 AddFour(const Widened& g, const float* x, __m256 acc) {
  for (int r = 0; r < 4; ++r) acc = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r), g.w[r], acc);
  return acc;
}

// One or two rows (decode): a panel would be widened for one use, so each group's codes are widened
// in registers and used at once, two tiles side by side (eight sums in flight hide the FMA latency).
// y for R (1 or 2) rows over tiles a and b (b may be a itself: its sums are then not stored).
template <int R>
__attribute__((target("avx2,fma,f16c")))
void FewRowsTwoTilesAvx2(const float* x, int k, const uint8_t* ta, const uint8_t* tb, float* ya, float* yb,
                         int ystride, int cols_a, int cols_b) {
  static_assert(R == 1 || R == 2, "one or two rows");
  const int nb = k / kBlock;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;      // row 0: tile a / b, halves 0 / 1
  __m256 a2 = a0, a3 = a0, b2 = a0, b3 = a0;                       // row 1
  const float* x1 = x + (R > 1 ? k : 0);
  for (int blk_i = 0; blk_i < nb; ++blk_i) {
    const uint8_t* pa = ta + static_cast<size_t>(blk_i) * kTileBlockBytesQ8;
    const uint8_t* pb = tb + static_cast<size_t>(blk_i) * kTileBlockBytesQ8;
    const __m256 da0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pa + 512)));
    const __m256 da1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pa + 528)));
    const __m256 db0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pb + 512)));
    const __m256 db1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pb + 528)));
    for (int g = 0; g < 8; ++g) {
      const int kk = blk_i * kBlock + 4 * g;
      const Widened wa0 = WidenGroup(pa + g * 64, da0), wa1 = WidenGroup(pa + g * 64 + 32, da1);
      a0 = AddFour(wa0, x + kk, a0);
      a1 = AddFour(wa1, x + kk, a1);
      if constexpr (R > 1) {
        a2 = AddFour(wa0, x1 + kk, a2);
        a3 = AddFour(wa1, x1 + kk, a3);
      }
      const Widened wb0 = WidenGroup(pb + g * 64, db0), wb1 = WidenGroup(pb + g * 64 + 32, db1);
      b0 = AddFour(wb0, x + kk, b0);
      b1 = AddFour(wb1, x + kk, b1);
      if constexpr (R > 1) {
        b2 = AddFour(wb0, x1 + kk, b2);
        b3 = AddFour(wb1, x1 + kk, b3);
      }
    }
  }
  const __m256 sums[2][2][2] = {{{a0, a1}, {a2, a3}}, {{b0, b1}, {b2, b3}}};     // [tile][row][half]
  float* ys[2] = {ya, yb};
  const int cols[2] = {cols_a, cols_b};
  for (int t = 0; t < (ta == tb ? 1 : 2); ++t) {
    for (int r = 0; r < R; ++r) {
      float out[kTile];
      _mm256_storeu_ps(out, sums[t][r][0]);
      _mm256_storeu_ps(out + 8, sums[t][r][1]);
      std::memcpy(ys[t] + static_cast<size_t>(r) * ystride, out, sizeof(float) * cols[t]);
    }
  }
}

using PanelFn = void (*)(const float*, int, const float*, float*, int, int);

PanelFn PanelAvx2Fn(int rows) {
  static const PanelFn fns[] = {RowsTimesPanelAvx2<1>, RowsTimesPanelAvx2<2>, RowsTimesPanelAvx2<3>,
                                RowsTimesPanelAvx2<4>, RowsTimesPanelAvx2<5>, RowsTimesPanelAvx2<6>};
  return fns[rows - 1];
}

}  // namespace

void MatMulTilesQ8Float(Isa isa, const float* x, int rows, int k, const uint8_t* w, int n, int t0, int t1, float* y) {
  const int nb = k / kBlock;
  const size_t tile_bytes = static_cast<size_t>(nb) * kTileBlockBytesQ8;
  if (isa != Isa::kScalar && rows <= 2) {
    for (int t = t0; t < t1; t += 2) {
      const int u = t + 1 < t1 ? t + 1 : t;      // the partner tile (itself when none is left)
      const int cols_t = n - t * kTile < kTile ? n - t * kTile : kTile, cols_u = n - u * kTile < kTile ? n - u * kTile : kTile;
      auto fn = rows == 1 ? FewRowsTwoTilesAvx2<1> : FewRowsTwoTilesAvx2<2>;
      fn(x, k, w + static_cast<size_t>(t) * tile_bytes, w + static_cast<size_t>(u) * tile_bytes,
         y + static_cast<size_t>(t) * kTile, y + static_cast<size_t>(u) * kTile, n, cols_t, cols_u);
    }
    return;
  }
  thread_local std::vector<float> panel;      // NOTE: per worker thread, reused: no allocation per call
  if (isa != Isa::kScalar) panel.resize(static_cast<size_t>(k) * kTile);
  for (int t = t0; t < t1; ++t) {
    const uint8_t* tile = w + static_cast<size_t>(t) * tile_bytes;
    const int cols = n - t * kTile < kTile ? n - t * kTile : kTile;
    float* yt = y + static_cast<size_t>(t) * kTile;
    if (isa == Isa::kScalar) {
      TileFloatScalar(x, rows, k, tile, yt, n, cols);
      continue;
    }
    WidenTileAvx2(tile, nb, panel.data());
    // rows in groups as even as six allows (32 = 6+6+5+5+5+5): a short last group would run its few
    // sums at the FMA's latency, not its throughput
    const int groups = (rows + kFloatRows - 1) / kFloatRows;
    for (int i = 0, m = 0; i < groups; ++i) {
      const int r = rows / groups + (i < rows % groups ? 1 : 0);
      PanelAvx2Fn(r)(x + static_cast<size_t>(m) * k, k, panel.data(), yt + static_cast<size_t>(m) * n, n, cols);
      m += r;
    }
  }
}

}  // namespace kiln_q4
