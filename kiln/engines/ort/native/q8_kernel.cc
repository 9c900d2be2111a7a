// kiln.MatMulQ8's arithmetic: 8-bit codes with a half-float scale per block of 32 (Q8_0), int8
// activations per block (q4min_kernel.h has the layout). Why a kernel of kiln's own for an 8-bit
// table: the LM head is a third of a SmolLM2 decode step's weight bytes, and ONNX Runtime's 8-bit
// MatMulNBits read it at about half the bandwidth this loop does (measured in the op's docstring).
#include <immintrin.h>

#include <cstring>

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

void MatMulTilesQ8Float(const float* x, int rows, int k, const uint8_t* w, int n, int t0, int t1, float* y) {
  const int nb = k / kBlock;
  const size_t tile_bytes = static_cast<size_t>(nb) * kTileBlockBytesQ8;
  for (int t = t0; t < t1; ++t) {
    const uint8_t* tile = w + static_cast<size_t>(t) * tile_bytes;
    const int cols = n - t * kTile < kTile ? n - t * kTile : kTile;
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
        y[static_cast<size_t>(m) * n + t * kTile + j] = acc;
      }
    }
  }
}

}  // namespace kiln_q4
