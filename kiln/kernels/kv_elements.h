// kiln's KV cache elements as 16 floats at a time (paged_kv_attention.h's formats): u8 codes and
// IEEE half floats. Included only by files build.py compiles once per level (paged_kv_attention.cc,
// paged_kv_attention_amx.cc), inside their anonymous namespace and after attention_math.h, so each
// copy widens with its level's instructions. The includer has <cmath>, <cstdint>, <cstring> and, from
// F16C or AVX-512 up, <immintrin.h>; and kLanes (16).
#pragma once

typedef uint8_t Codes __attribute__((vector_size(16)));

// The element formats: 16 consecutive elements as floats, and what a stored token carries.
struct U8Codes {
  static constexpr KvFormat kFormat = KvFormat::kU8;
  static constexpr int kBytes = 1;
  static constexpr bool kAffine = true;     // a scale and a minimum per token
  static constexpr bool kFromMemory = true;  // the next block is fetched ahead
  static KILN_INLINE Lanes Widen(const uint8_t* codes) {
#ifdef __AVX512F__
    // NOTE: spelled out: GCC's generic conversion of 16 u8 lanes went through scalar code
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
    Lanes x;
    std::memcpy(&x, &v, sizeof x);
    return x;
#else
    Codes c;
    std::memcpy(&c, codes, sizeof c);
    return __builtin_convertvector(__builtin_convertvector(c, LaneIndex), Lanes);
#endif
  }
};

// An IEEE half float's value (the scalar copy's path; the others convert 8 or 16 at once).
KILN_INLINE float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {
    float f = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -f : f;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct F16Values {
  static constexpr KvFormat kFormat = KvFormat::kF16;
  static constexpr int kBytes = 2;
  static constexpr bool kAffine = false;
  static constexpr bool kFromMemory = true;
  static KILN_INLINE Lanes Widen(const uint8_t* halves) {
    Lanes x;
#if defined(__AVX512F__)
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves)));
    std::memcpy(&x, &v, sizeof x);
#elif defined(__F16C__)
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves)));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves) + 1));
    std::memcpy(&x, &lo, sizeof lo);
    std::memcpy(reinterpret_cast<float*>(&x) + 8, &hi, sizeof hi);
#else
    for (int i = 0; i < kLanes; ++i) {
      uint16_t h;
      std::memcpy(&h, halves + 2 * i, sizeof h);
      x[i] = HalfToFloat(h);
    }
#endif
    return x;
  }
};
