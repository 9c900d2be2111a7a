// The packed weight layouts kiln's kernels read, one description each: the byte map as a comment and
// every size and offset as a named constant, so no kernel writes a layout's offset as a number. The
// packers that write them are Python (kiln/compiler/passes/q4min_linear.py: Q4_1 and Q8_0;
// kiln/compiler/backends/openvino/int8_linears.py: I8PerChannel).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kiln {

constexpr int kTileColumns = 16;       // every layout packs 16 output columns side by side: one tile
constexpr int kHalfBytes = 2;          // an IEEE half float
constexpr int kWordBytes = 4;          // one column's four consecutive k codes: one vpdpbusd lane
constexpr int kBlock = 32;             // Q4_1's and Q8_0's block along K, and their activations'

// Q4_1 (llama.cpp's name; kiln.MatMulQ4Min): 4-bit codes with a half-float scale and minimum per
// block of 32 along K:
//     W[k, n] = d[n, b] * q[k, n] + mn[n, b]          b = k / 32, q in 0..15
// One tile-block (16 columns by 32 rows of K) in 320 bytes:
//     bytes   0..255  codes: byte i*64 + j*4 + r = q[8i + r, j] | q[8i + 4 + r, j] << 4   (i < 4, j < 16, r < 4)
//     bytes 256..287  d[j]  as 16 IEEE half floats
//     bytes 288..319  mn[j] as 16 IEEE half floats
// A linear: [ceil(N / 16), K / 32, 320] bytes; the last tile's padding columns are zeros.
struct Q4_1 {
  static constexpr int kBlock = kiln::kBlock;                           // rows of K per block
  static constexpr int kGroups = 4;                                     // i: code groups per block
  static constexpr int kGroupBytes = kTileColumns * kWordBytes;        // 64
  static constexpr int kGroupRows = 8;                                  // rows of K per group ...
  static constexpr int kHighRows = 4;                                   // ... the high nibbles 4 rows past the low
  static constexpr int kScales = kGroups * kGroupBytes;                 // 256: d
  static constexpr int kMins = kScales + kTileColumns * kHalfBytes;     // 288: mn
  static constexpr int kBlockBytes = kMins + kTileColumns * kHalfBytes; // 320
  static size_t TileBytes(int k) { return static_cast<size_t>(k / kBlock) * kBlockBytes; }
};

// Q8_0 (llama.cpp's name; kiln.MatMulQ8): 8-bit codes with a half-float scale per block of 32:
//     W[k, n] = d[n, b] * q[k, n]                      b = k / 32, q in -127..127
// One tile-block in 544 bytes:
//     bytes   0..511  codes: byte g*64 + j*4 + r = q[4g + r, j] as int8   (g < 8, j < 16, r < 4)
//     bytes 512..543  d[j] as 16 IEEE half floats
// A linear: [ceil(N / 16), K / 32, 544] bytes.
struct Q8_0 {
  static constexpr int kBlock = kiln::kBlock;
  static constexpr int kGroups = 8;                                     // g: code groups per block
  static constexpr int kGroupBytes = kTileColumns * kWordBytes;        // 64
  static constexpr int kGroupRows = kWordBytes;                         // 4 rows of K per group
  static constexpr int kScales = kGroups * kGroupBytes;                 // 512: d
  static constexpr int kBlockBytes = kScales + kTileColumns * kHalfBytes;   // 544
  static size_t TileBytes(int k) { return static_cast<size_t>(k / kBlock) * kBlockBytes; }
};

// int8 per output channel (kiln.LinearI8 / kiln.GateUpI8, the OpenVINO extension): one scale per
// output column, no blocks along K. Three arrays per linear:
//     codes [N/16][K4][16][4] int8, K4 = ceil(K / 4): tile t (16 columns, a "panel" of K4 * 64 bytes),
//           step s holds q[4s + r, 16t + j] at byte s*64 + j*4 + r; K's padding rows are zero codes
//     scale [N] float: the column's scale (its absmax / 127)
//     comp  [N] float: 128 x the column's sum of codes (what u8s8.h's offset adds, taken off each sum)
// N is a multiple of 16.
struct I8PerChannel {
  static constexpr int kStepRows = kWordBytes;                          // 4 rows of K per step
  static constexpr int kStepBytes = kTileColumns * kWordBytes;          // 64
  static int PaddedK(int k) { return (k + kStepRows - 1) / kStepRows * kStepRows; }
  static size_t TileBytes(int k) { return static_cast<size_t>(PaddedK(k) / kStepRows) * kStepBytes; }
};

}  // namespace kiln
