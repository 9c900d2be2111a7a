// Signed int8 times signed int8 on vpdpbusd, which multiplies unsigned bytes by signed ones: the one
// place the offset and its compensation are written. Used by Q8_0 (kiln.MatMulQ8: the weights' codes
// go in offset) and I8PerChannel (kiln.LinearI8 / GateUpI8: the activations' codes go in offset).
//
// One operand a goes in offset by 128 (a + 128, 0..255), which adds 128 x sum(b) to every dot with
// the other operand b; each int32 sum starts at minus that share, so what it adds up is exactly a . b:
//     sum_i (a_i + 128) * b_i  -  128 * sum_i b_i  =  sum_i a_i * b_i
// The share is known before the products: the sum of b's codes (per activation block for Q8_0,
// BlockSums; per weight column for I8PerChannel, packed in Python as comp).
// Included only by files compiled for AVX-512 VNNI.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kiln {
namespace u8s8 {

constexpr int32_t kOffset = 128;

#define KILN_U8S8 inline __attribute__((always_inline))

// 4 consecutive activation codes (one vpdpbusd lane's worth) as one int32, from any address
KILN_U8S8 int32_t Word(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// a + 128 as u8, for int8 codes (their sign bit flipped)
KILN_U8S8 __m512i Offset(__m512i a) { return _mm512_xor_si512(a, _mm512_set1_epi8(static_cast<char>(0x80))); }

// a sum's start: minus the offset's share, 128 x the sum of b (all lanes the same) ...
KILN_U8S8 __m512i Start(int32_t sum_of_b) { return _mm512_set1_epi32(-kOffset * sum_of_b); }
// ... or given as that share per lane
KILN_U8S8 __m512i StartFromShare(__m512i share) { return _mm512_sub_epi32(_mm512_setzero_si512(), share); }

#undef KILN_U8S8

}  // namespace u8s8
}  // namespace kiln
