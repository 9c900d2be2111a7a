// kiln's KV cache elements as 16 floats at a time (paged_kv_attention.h's formats and layouts): u8
// codes and IEEE half floats. Included only by files build.py compiles once per level
// (paged_kv_attention.cc, paged_kv_attention_amx.cc), inside their anonymous namespace and after
// attention_math.h, so each copy widens with its level's instructions. The includer has <cmath>,
// <cstdint>, <cstring> and, from F16C or AVX-512 up, <immintrin.h>; and kLanes (16).
//
// Each format answers two questions of a block's segment: Keys(codes, bs, d, h16), dimension d of the
// 16 keys from slot h16; Values(codes, hd, slot, c), dimensions c .. c + 15 of one token's value.
// Prefetch asks for a segment's bytes ahead of their use.
#pragma once

typedef uint32_t CodeWords __attribute__((vector_size(64)));

// Byte b of 16 consecutive 32-bit words, as floats.
KILN_INLINE Lanes ByteOfWords(const uint8_t* words, int b) {
#ifdef __AVX512F__
  const __m512i w = _mm512_srlv_epi32(_mm512_loadu_si512(words), _mm512_set1_epi32(8 * b));
  const __m512 v = _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(0xff)));
  Lanes x;
  std::memcpy(&x, &v, sizeof x);
  return x;
#else
  CodeWords w;
  std::memcpy(&w, words, sizeof w);
  return __builtin_convertvector(__builtin_convertvector((w >> (8 * b)) & 0xff, LaneIndex), Lanes);
#endif
}

// u8 codes in 32-bit words of four (the layout AVX-512 VNNI's vpdpbusd multiplies, 4 products per word):
//   keys    [hd / 4][block_size][4]: a word holds 4 consecutive dimensions of one key
//   values  [block_size / 4][hd][4]: a word holds one dimension of 4 consecutive keys
struct U8Codes {
  static constexpr KvFormat kFormat = KvFormat::kU8;
  static constexpr bool kAffine = true;     // a scale and a minimum per token
  static constexpr bool kFromMemory = true;  // the next block is fetched ahead
  static KILN_INLINE Lanes Keys(const uint8_t* codes, int bs, int d, int h16) {
    return ByteOfWords(codes + (static_cast<size_t>(d / 4) * bs + h16) * 4, d % 4);
  }
  static KILN_INLINE Lanes Values(const uint8_t* codes, int hd, int slot, int c) {
    return ByteOfWords(codes + (static_cast<size_t>(slot / 4) * hd + c) * 4, slot % 4);
  }
  // Where a code sits in its segment (the store's side of the layout).
  static KILN_INLINE size_t KeyAt(int bs, int d, int slot) { return (static_cast<size_t>(d / 4) * bs + slot) * 4 + d % 4; }
  static KILN_INLINE size_t ValueAt(int hd, int d, int slot) {
    return (static_cast<size_t>(slot / 4) * hd + d) * 4 + slot % 4;
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

// IEEE half floats: keys [hd][block_size] (16 keys of one dimension side by side), values
// [block_size][hd].
struct F16Values {
  static constexpr KvFormat kFormat = KvFormat::kF16;
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
  static KILN_INLINE Lanes Keys(const uint8_t* codes, int bs, int d, int h16) {
    return Widen(codes + (static_cast<size_t>(d) * bs + h16) * 2);
  }
  static KILN_INLINE Lanes Values(const uint8_t* codes, int hd, int slot, int c) {
    return Widen(codes + (static_cast<size_t>(slot) * hd + c) * 2);
  }
};

// Asks for bytes [from, from + bytes) of a cache ahead of their use, into the cache level `Locality`
// names (__builtin_prefetch's: 3 is L1, 2 L2, 1 the last level).
template <int Locality>
KILN_INLINE void Prefetch(const uint8_t* from, size_t bytes) {
  for (size_t at = 0; at < bytes; at += 64) __builtin_prefetch(from + at, 0, Locality);
}
