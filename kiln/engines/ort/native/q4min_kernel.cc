// MatMulQ4Min's arithmetic (q4min_kernel.h has the formula and the weight layout). Each vector path is
// compiled for its own target with function attributes and chosen at run time, so the library runs on
// any x86-64 CPU: AVX-512 VNNI (vpdpbusd), AVX2 (pmaddubsw), or plain C++.
#include "q4min_kernel.h"

#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace kiln_q4 {

namespace {

constexpr int kRowGroup = 4;    // rows that share one unpacking of a tile's codes

inline int32_t Word(const int8_t* p) {      // 4 activation bytes as one int32 (unaligned)
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {                       // subnormal half: normalise
    int e = -1;
    uint32_t m = mant;
    do { m <<= 1; ++e; } while (!(m & 0x400));
    bits = sign | ((112 - e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

namespace {

// ---- scalar -------------------------------------------------------------------------------------
void TileScalar(const int8_t* xq, const float* dx, const float* xs, int rows, int k, const uint8_t* tile,
                float* y, int ystride, int cols) {
  const int nb = k / kBlock;
  for (int m = 0; m < rows; ++m) {
    float acc[kTile] = {0}, off[kTile] = {0};
    for (int b = 0; b < nb; ++b) {
      const uint8_t* blk = tile + static_cast<size_t>(b) * kTileBlockBytes;
      const int8_t* x = xq + static_cast<size_t>(m) * k + b * kBlock;
      uint16_t d16[kTile], m16[kTile];
      std::memcpy(d16, blk + 256, sizeof d16);
      std::memcpy(m16, blk + 288, sizeof m16);
      for (int j = 0; j < kTile; ++j) {
        int32_t dot = 0;
        for (int i = 0; i < 4; ++i) {
          for (int r = 0; r < 4; ++r) {
            const uint8_t byte = blk[i * 64 + j * 4 + r];
            dot += (byte & 0x0f) * x[8 * i + r] + (byte >> 4) * x[8 * i + 4 + r];
          }
        }
        acc[j] = std::fma(static_cast<float>(dot), HalfToFloat(d16[j]) * dx[m * nb + b], acc[j]);
        off[j] = std::fma(HalfToFloat(m16[j]), xs[m * nb + b], off[j]);
      }
    }
    for (int j = 0; j < cols; ++j) y[static_cast<size_t>(m) * ystride + j] = acc[j] + off[j];
  }
}

// ---- AVX2 ---------------------------------------------------------------------------------------
// pmaddubsw sums two u8 x s8 products into int16: each is at most 15 * 127, so the eight products a
// block's 32 codes give per output fit int16 (8 * 2 * 1905 = 30480 < 32767) before one pmaddwd.
template <int R>
__attribute__((target("avx2,fma,f16c")))
void TileAvx2(const int8_t* xq, const float* dx, const float* xs, int k, const uint8_t* tile, float* y,
              int ystride, int cols) {
  const int nb = k / kBlock;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {              // columns 8h .. 8h + 7
    __m256 acc[R], off[R];
    for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      const uint8_t* blk = tile + static_cast<size_t>(b) * kTileBlockBytes;
      __m256i lo[4], hi[4];
      for (int i = 0; i < 4; ++i) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + i * 64 + h * 32));
        lo[i] = _mm256_and_si256(v, low);
        hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 256 + h * 16)));
      const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 288 + h * 16)));
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xq + static_cast<size_t>(r) * k + b * kBlock;
        __m256i s16 = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[i], _mm256_set1_epi32(Word(x + 8 * i))));
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[i], _mm256_set1_epi32(Word(x + 8 * i + 4))));
        }
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])), acc[r]);
        off[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[r * nb + b]), off[r]);
      }
    }
    const int valid = cols - 8 * h;
    for (int r = 0; r < R && valid > 0; ++r) {
      float out[8];
      _mm256_storeu_ps(out, _mm256_add_ps(acc[r], off[r]));
      std::memcpy(y + static_cast<size_t>(r) * ystride + 8 * h, out, sizeof(float) * (valid < 8 ? valid : 8));
    }
  }
}

// One row: both 8-column halves in one pass over a block, so each activation word is broadcast once
// (a row has no other rows to share the unpacked codes with).
__attribute__((target("avx2,fma,f16c")))
void TileAvx2OneRow(const int8_t* xq, const float* dx, const float* xs, int k, const uint8_t* tile, float* y,
                    int /*ystride*/, int cols) {
  const int nb = k / kBlock;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), off0 = _mm256_setzero_ps(), off1 = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + static_cast<size_t>(b) * kTileBlockBytes;
    const int8_t* x = xq + b * kBlock;
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + i * 64));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + i * 64 + 32));
      const __m256i xl = _mm256_set1_epi32(Word(x + 8 * i)), xh = _mm256_set1_epi32(Word(x + 8 * i + 4));
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_and_si256(v0, low), xl));
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low), xh));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_and_si256(v1, low), xl));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low), xh));
    }
    const __m256 scale = _mm256_set1_ps(dx[b]), sum = _mm256_set1_ps(xs[b]);
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 256)));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 272)));
    const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 288)));
    const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 304)));
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s0, ones)), _mm256_mul_ps(d0, scale), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s1, ones)), _mm256_mul_ps(d1, scale), acc1);
    off0 = _mm256_fmadd_ps(m0, sum, off0);
    off1 = _mm256_fmadd_ps(m1, sum, off1);
  }
  float out[kTile];
  _mm256_storeu_ps(out, _mm256_add_ps(acc0, off0));
  _mm256_storeu_ps(out + 8, _mm256_add_ps(acc1, off1));
  std::memcpy(y, out, sizeof(float) * cols);
}

// ---- AVX-512 VNNI -------------------------------------------------------------------------------
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
void TileAvx512(const int8_t* xq, const float* dx, const float* xs, int k, const uint8_t* tile, float* y,
                int ystride, int cols) {
  const int nb = k / kBlock;
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + static_cast<size_t>(b) * kTileBlockBytes;
    __m512i lo[4], hi[4];
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_loadu_si512(blk + i * 64);
      lo[i] = _mm512_and_si512(v, low);
      hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + static_cast<size_t>(r) * k + b * kBlock;
      // two chains of four, so the dependent vpdpbusd latency halves
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int i = 0; i < 4; ++i) {
        s0 = _mm512_dpbusd_epi32(s0, lo[i], _mm512_set1_epi32(Word(x + 8 * i)));
        s1 = _mm512_dpbusd_epi32(s1, hi[i], _mm512_set1_epi32(Word(x + 8 * i + 4)));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
      off[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[r * nb + b]), off[r]);
    }
  }
  const __mmask16 mask = cols >= kTile ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + static_cast<size_t>(r) * ystride, mask, _mm512_add_ps(acc[r], off[r]));
}

using TileFn = void (*)(const int8_t*, const float*, const float*, int, const uint8_t*, float*, int, int);

TileFn Avx512Fn(int rows) {
  switch (rows) {
    case 1: return TileAvx512<1>;
    case 2: return TileAvx512<2>;
    case 3: return TileAvx512<3>;
    default: return TileAvx512<4>;
  }
}

TileFn Avx2Fn(int rows) {
  switch (rows) {
    case 1: return TileAvx2OneRow;
    case 2: return TileAvx2<2>;
    case 3: return TileAvx2<3>;
    default: return TileAvx2<4>;
  }
}

Isa Detected() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c"))
    return Isa::kAvx512Vnni;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::kAvx2;
  return Isa::kScalar;
}

}  // namespace

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni: return "avx512vnni";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

Isa SelectIsa() {
  const Isa best = Detected();
  const char* cap = std::getenv("KILN_Q4_ISA");
  if (cap == nullptr || *cap == '\0') return best;
  Isa want = Isa::kAvx512Vnni;
  if (std::strcmp(cap, "scalar") == 0) want = Isa::kScalar;
  else if (std::strcmp(cap, "avx2") == 0) want = Isa::kAvx2;
  return static_cast<int>(want) < static_cast<int>(best) ? want : best;
}

namespace {

// NOTE: cvtss2si rounds by MXCSR (nearest, ties to even) like the vector paths' cvtps2dq; it is
// baseline x86-64, where std::nearbyint would be a libm call per element.
inline int8_t RoundToInt8(float v) { return static_cast<int8_t>(_mm_cvtss_si32(_mm_set_ss(v))); }

void QuantizeRowScalar(const float* x, int k, int8_t* xq, float* dx, float* xs) {
  for (int b = 0; b < k / kBlock; ++b) {
    const float* v = x + b * kBlock;
    float amax = 0.0f, sum = 0.0f;
    for (int i = 0; i < kBlock; ++i) {
      const float a = std::fabs(v[i]);
      amax = a > amax ? a : amax;
      sum += v[i];
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < kBlock; ++i) xq[b * kBlock + i] = RoundToInt8(v[i] * inv);
    dx[b] = amax / 127.0f;
    xs[b] = sum;
  }
}

__attribute__((target("avx2,fma")))
void QuantizeRowAvx2(const float* x, int k, int8_t* xq, float* dx, float* xs) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int b = 0; b < k / kBlock; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      sum = _mm256_add_ps(sum, v[i]);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1));
    const float a = _mm_cvtss_f32(m4);
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

__attribute__((target("avx512f,avx512bw,avx512vl")))
void QuantizeRowAvx512(const float* x, int k, int8_t* xq, float* dx, float* xs) {
  for (int b = 0; b < k / kBlock; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * kBlock), v1 = _mm512_loadu_ps(x + b * kBlock + 16);
    const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 inv = _mm512_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
    dx[b] = a / 127.0f;
    xs[b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
  }
}

}  // namespace

void QuantizeRow(Isa isa, const float* x, int k, int8_t* xq, float* dx, float* xs) {
  if (isa == Isa::kAvx512Vnni) QuantizeRowAvx512(x, k, xq, dx, xs);
  else if (isa == Isa::kAvx2) QuantizeRowAvx2(x, k, xq, dx, xs);
  else QuantizeRowScalar(x, k, xq, dx, xs);
}

void MatMulTiles(Isa isa, const int8_t* xq, const float* dx, const float* xs, int rows, int k,
                 const uint8_t* w, int n, int t0, int t1, float* y) {
  const int nb = k / kBlock;
  const size_t tile_bytes = static_cast<size_t>(nb) * kTileBlockBytes;
  for (int t = t0; t < t1; ++t) {
    const uint8_t* tile = w + static_cast<size_t>(t) * tile_bytes;
    const int cols = n - t * kTile < kTile ? n - t * kTile : kTile;
    for (int m = 0; m < rows; m += kRowGroup) {
      const int r = rows - m < kRowGroup ? rows - m : kRowGroup;
      const int8_t* xm = xq + static_cast<size_t>(m) * k;
      float* ym = y + static_cast<size_t>(m) * n + t * kTile;
      if (isa == Isa::kAvx512Vnni) Avx512Fn(r)(xm, dx + m * nb, xs + m * nb, k, tile, ym, n, cols);
      else if (isa == Isa::kAvx2) Avx2Fn(r)(xm, dx + m * nb, xs + m * nb, k, tile, ym, n, cols);
      else TileScalar(xm, dx + m * nb, xs + m * nb, r, k, tile, ym, n, cols);
    }
  }
}

void MatMulTilesFloat(const float* x, int rows, int k, const uint8_t* w, int n, int t0, int t1, float* y) {
  const int nb = k / kBlock;
  const size_t tile_bytes = static_cast<size_t>(nb) * kTileBlockBytes;
  for (int t = t0; t < t1; ++t) {
    const uint8_t* tile = w + static_cast<size_t>(t) * tile_bytes;
    const int cols = n - t * kTile < kTile ? n - t * kTile : kTile;
    for (int m = 0; m < rows; ++m) {
      const float* xm = x + static_cast<size_t>(m) * k;
      for (int j = 0; j < cols; ++j) {
        float acc = 0.0f;
        for (int b = 0; b < nb; ++b) {
          const uint8_t* blk = tile + static_cast<size_t>(b) * kTileBlockBytes;
          uint16_t d16, m16;
          std::memcpy(&d16, blk + 256 + 2 * j, 2);
          std::memcpy(&m16, blk + 288 + 2 * j, 2);
          const float d = HalfToFloat(d16), mn = HalfToFloat(m16);
          for (int i = 0; i < 4; ++i) {
            for (int r = 0; r < 4; ++r) {
              const uint8_t byte = blk[i * 64 + j * 4 + r];
              acc += xm[b * kBlock + 8 * i + r] * (d * (byte & 0x0f) + mn);
              acc += xm[b * kBlock + 8 * i + 4 + r] * (d * (byte >> 4) + mn);
            }
          }
        }
        y[static_cast<size_t>(m) * n + t * kTile + j] = acc;
      }
    }
  }
}

}  // namespace kiln_q4
