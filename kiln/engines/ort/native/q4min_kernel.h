// MatMulQ4Min's arithmetic, without ONNX Runtime: y[m, n] = x[m, :] · W[:, n] for W stored as 4-bit
// codes with a float scale and a float minimum per block of 32 along K (llama.cpp's Q4_1):
//     W[k, n] = d[n, b] * q[k, n] + mn[n, b]          b = k / 32, q in 0..15
// Each row of x is quantized per block to int8 with a float scale dx and keeps its float block sum xs:
//     y[m, n] = sum_b( d[n, b] * dx[m, b] * dot(q[., n], xq[m, .]) + mn[n, b] * xs[m, b] )
// The integer dot is exact (u8 x s8, vpdpbusd on AVX-512 VNNI; pmaddubsw on AVX2).
//
// Weight layout, one tile of 16 output columns by one block of 32 rows of K in 320 bytes:
//     bytes   0..255  codes: byte i*64 + j*4 + r = q[8i + r, j] | q[8i + 4 + r, j] << 4   (i < 4, j < 16, r < 4)
//     bytes 256..287  d[j]  as 16 IEEE half floats
//     bytes 288..319  mn[j] as 16 IEEE half floats
// tiles of a linear: [ceil(N / 16), K / 32, 320] bytes; the last tile's padding columns are zeros.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kiln_q4 {

constexpr int kBlock = 32;
constexpr int kTile = 16;
constexpr int kTileBlockBytes = 320;

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2 };

// The best path this CPU runs, capped by the KILN_Q4_ISA environment variable (scalar | avx2 | avx512vnni).
Isa SelectIsa();
const char* IsaName(Isa isa);

// One row's activations quantized per block: xq [K] int8, dx [K/32], xs [K/32]. Every path rounds
// x * (127 / amax) to the nearest int8, ties to even; only the block sums' addition order differs.
void QuantizeRow(Isa isa, const float* x, int k, int8_t* xq, float* dx, float* xs);

// y[m, n0 .. n1) for rows m in [0, rows), tiles t in [t0, t1); y's row stride is n (the valid columns).
void MatMulTiles(Isa isa, const int8_t* xq, const float* dx, const float* xs, int rows, int k,
                 const uint8_t* w, int n, int t0, int t1, float* y);

// The 8-bit form (llama.cpp's Q8_0; kiln.MatMulQ8): W[k, n] = d[n, b] * q[k, n], q in -127..127.
// Tile-block of 544 bytes: byte g*64 + j*4 + r = q[4g + r, j] as int8 (g < 8), then d[j] as 16 half
// floats. xqsum [rows, K/32]: each activation block's int8 sum (the AVX-512 path offsets codes by 128).
constexpr int kTileBlockBytesQ8 = 544;
void MatMulTilesQ8(Isa isa, const int8_t* xq, const float* dx, const int32_t* xqsum, int rows, int k,
                   const uint8_t* w, int n, int t0, int t1, float* y);
// Float activations (accuracy_level 0): f32 fused multiply-adds over the widened weights, k in order.
void MatMulTilesQ8Float(Isa isa, const float* x, int rows, int k, const uint8_t* w, int n, int t0, int t1, float* y);
// int16 activations (accuracy_level 2, q8_int16_kernel.cc): each row quantized per block of 32 to
// int16, xq [K] with dx [K/32] = amax / 32767 (x * (32767 / amax) rounded to nearest, ties to even);
// y[m, n] = sum_b float(dot(q, xq)) * (d[n, b] * dx[m, b]), one fused multiply-add per block, b in order.
void QuantizeRowI16(Isa isa, const float* x, int k, int16_t* xq, float* dx);
void MatMulTilesQ8Int16(Isa isa, const int16_t* xq, const float* dx, int rows, int k, const uint8_t* w, int n,
                        int t0, int t1, float* y);
float HalfToFloat(uint16_t h);

// The same product with float activations (accuracy_level 0: the build's layout checks, as MatMulNBits'
// level 0): y[m, n] = sum_k x[m, k] * (d * q + mn), one row at a time, plain C++.
void MatMulTilesFloat(const float* x, int rows, int k, const uint8_t* w, int n, int t0, int t1, float* y);

}  // namespace kiln_q4
