// The vector arithmetic both attention kernels inline (paged_attention.cc over an f32 pool,
// paged_attention_u8.cc over kiln's u8 cache): 16-float lanes, their sums, and e^x. Included only by
// files build.py compiles once per level, inside their anonymous namespace, so each copy vectorizes
// for its level's instructions.
// The includer has <cmath>, <cstdint> and <cstring> already (this text lands inside its namespace).
#pragma once

#define KILN_INLINE inline __attribute__((always_inline))

// 16 floats as one value: one AVX-512 register in that copy, two AVX2 or four SSE ones in the others.
typedef float Lanes __attribute__((vector_size(64)));
typedef int32_t LaneIndex __attribute__((vector_size(64)));
// 8 floats: one AVX2 register. The decode path's dot products reduce these (a 16-float sum across
// lanes costs cross-register shuffles on AVX2).
typedef float Lanes8 __attribute__((vector_size(32)));
typedef int32_t LaneIndex8 __attribute__((vector_size(32)));

template <typename V = Lanes>
KILN_INLINE V Load(const float* x) {
  V v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

// The lanes' sum, by halving: 4 + 4, 2 + 2, 1 + 1 (3 shuffles, not 7 scalar adds).
KILN_INLINE float Total8(Lanes8 v) {
  v += __builtin_shuffle(v, LaneIndex8{4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, LaneIndex8{2, 3, 0, 1, 6, 7, 4, 5});
  v += __builtin_shuffle(v, LaneIndex8{1, 0, 3, 2, 5, 4, 7, 6});
  return v[0];
}

// 8 + 8, then the same halving.
KILN_INLINE float Total(Lanes v) {
  Lanes8 halves[2];
  std::memcpy(halves, &v, sizeof v);
  return Total8(halves[0] + halves[1]);
}

// e^r for 0 <= r < ln 2, by its Taylor series to the 7th power (relative error < 2e-6): for one
// float or for 16 at once.
template <typename T>
KILN_INLINE T ExpSeries(T r) {
  T poly = r * 0.f + 1.f / 5040.f;
  poly = poly * r + 1.f / 720.f;
  poly = poly * r + 1.f / 120.f;
  poly = poly * r + 1.f / 24.f;
  poly = poly * r + 1.f / 6.f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.f;
  return poly * r + 1.f;
}

// e^x for 16 values x <= 0 at once, the scalar loop's way (below): lanes where x is -inf give 0 only
// through the mask the caller applies.
KILN_INLINE Lanes ExpLanes(Lanes x) {
  Lanes t = x * 1.4426950409f;
  t = t < -126.f ? Lanes{} - 126.f : t;
  LaneIndex whole = __builtin_convertvector(t, LaneIndex);          // rounds toward zero ...
  Lanes whole_f = __builtin_convertvector(whole, Lanes);
  whole -= whole_f > t ? 1 : 0;                                       // ... so step down below zero
  whole_f = __builtin_convertvector(whole, Lanes);
  return ExpSeries((t - whole_f) * 0.6931471806f) * (Lanes)((whole + 127) << 23);       // NOTE: a vector cast keeps the bits
}

// e^x for x <= 0 (scores less their maximum), branch-free so the loop vectorizes: x = (n + f) ln 2
// with n an integer and 0 <= f < 1; 2^f = e^(f ln 2) by ExpSeries, 2^n written into the exponent
// bits. Below -87 the result underflows to ~0.
KILN_INLINE float ExpAndSum(float* x, int n, float shift) {
  int i = 0;
  for (; i + 16 <= n; i += 16) {                 // 16 at a time, then one at a time
    const Lanes e = ExpLanes(Load(x + i) - shift);
    std::memcpy(x + i, &e, sizeof e);
  }
  for (; i < n; ++i) {
    float t = (x[i] - shift) * 1.4426950409f;
    t = t < -126.f ? -126.f : t;
    const float whole = std::floor(t);
    const float poly = ExpSeries((t - whole) * 0.6931471806f);
    const int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    x[i] = poly * two_n;
  }
  Lanes lanes = {};
  i = 0;
  for (; i + 16 <= n; i += 16) lanes += Load(x + i);
  float sum = Total(lanes);
  for (; i < n; ++i) sum += x[i];
  return sum;
}
