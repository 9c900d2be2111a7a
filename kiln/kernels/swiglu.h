// Llama's gated MLP activation, silu(g) * u, on AVX-512: what the I8PerChannel gate-up micro-kernels
// (the avx512vnni and amx levels') apply to their two products. Included only by files compiled for
// AVX-512; everything here has internal linkage, so each level's file keeps its own copy (build.py's
// check refuses shared inline symbols between levels).
#pragma once

#include <immintrin.h>

#include <cstddef>

#include "formats.h"

namespace kiln {
namespace {

// exp(x), x clamped below at -87: 2^n * p(f), a degree-5 polynomial in f (relative error ~2e-7).
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f));
  __m512 p = _mm512_set1_ps(1.f / 120);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// y = silu(g) * u over `rows` rows of `tiles` 16-column tiles; g and u hold rows `gstride` floats apart.
inline void SwiGlu(const float* g, const float* u, size_t gstride, int rows, int tiles, float* y, size_t ldy) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < tiles; ++j) {
      const size_t at = static_cast<size_t>(r) * gstride + j * kTileColumns;
      const __m512 gv = _mm512_loadu_ps(g + at), uv = _mm512_loadu_ps(u + at);
      const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, Exp(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      _mm512_storeu_ps(y + r * ldy + j * kTileColumns, _mm512_mul_ps(_mm512_mul_ps(gv, sig), uv));
    }
}

}  // namespace
}  // namespace kiln
