// The scalar level's micro-kernels: plain C++ for any x86-64 (compiled with no -m flags), the
// reference every vector level is tested against. Each keeps its summation order: the integer dots
// are exact, the float sums add block after block (k after k for float activations).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "driver.h"
#include "kernels.h"

namespace kiln {
namespace {

constexpr int kRowGroup = 4;    // rows per call of the int8 micro-kernels

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

// Column j's half float at byte `offset` of a tile-block.
float HalfAt(const uint8_t* blk, int offset, int j) {
  uint16_t h;
  std::memcpy(&h, blk + offset + j * kHalfBytes, kHalfBytes);
  return HalfToFloat(h);
}

// Q8_0's code of column j, row 4g + r of a block.
int8_t Q8Code(const uint8_t* blk, int g, int j, int r) {
  return static_cast<int8_t>(blk[g * Q8_0::kGroupBytes + j * kWordBytes + r]);
}

// ---- activations --------------------------------------------------------------------------------

// NOTE: cvtss2si rounds by MXCSR (nearest, ties to even) like the vector levels' cvtps2dq; it is
// baseline x86-64, where std::nearbyint would be a libm call per element.
inline int32_t RoundToInt(float v) { return _mm_cvtss_si32(_mm_set_ss(v)); }

void QuantizeI8(const float* x, int k, int8_t* xq, float* dx, float* xs) {
  for (int b = 0; b < k / kBlock; ++b) {
    const float* v = x + b * kBlock;
    float amax = 0.0f, sum = 0.0f;
    for (int i = 0; i < kBlock; ++i) {
      const float a = std::fabs(v[i]);
      amax = a > amax ? a : amax;
      sum += v[i];
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < kBlock; ++i) xq[b * kBlock + i] = static_cast<int8_t>(RoundToInt(v[i] * inv));
    dx[b] = amax / 127.0f;
    xs[b] = sum;
  }
}

void QuantizeI16(const float* x, int k, int16_t* xq, float* dx) {
  for (int b = 0; b < k / kBlock; ++b) {
    const float* v = x + b * kBlock;
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::fabs(v[i]) > amax ? std::fabs(v[i]) : amax;
    const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    for (int i = 0; i < kBlock; ++i) xq[b * kBlock + i] = static_cast<int16_t>(RoundToInt(v[i] * inv));
    dx[b] = amax / 32767.0f;
  }
}

// ---- Q4_1 ---------------------------------------------------------------------------------------

// int8 activations: acc += float(dot) * (d * dx) and off += mn * xs, fused, block after block.
struct Q4_1Int8 : OneTileMicro {
  RowGroups Groups(int) const { return {kRowGroup}; }
  void Run(const TileStep& s, const RowGroup& g, const Int8Rows& x, float* y, size_t ystride) const {
    const int nb = x.k / kBlock;
    for (int m = 0; m < g.rows; ++m) {
      float acc[kTileColumns] = {0}, off[kTileColumns] = {0};
      for (int b = 0; b < nb; ++b) {
        const uint8_t* blk = s.at + static_cast<size_t>(b) * Q4_1::kBlockBytes;
        const int8_t* xb = x.q + static_cast<size_t>(m) * x.k + b * kBlock;
        for (int j = 0; j < kTileColumns; ++j) {
          int32_t dot = 0;
          for (int i = 0; i < Q4_1::kGroups; ++i) {
            for (int r = 0; r < kWordBytes; ++r) {
              const uint8_t byte = blk[i * Q4_1::kGroupBytes + j * kWordBytes + r];
              dot += (byte & 0x0f) * xb[Q4_1::kGroupRows * i + r] +
                     (byte >> 4) * xb[Q4_1::kGroupRows * i + Q4_1::kHighRows + r];
            }
          }
          acc[j] = std::fma(static_cast<float>(dot), HalfAt(blk, Q4_1::kScales, j) * x.scale[m * nb + b], acc[j]);
          off[j] = std::fma(HalfAt(blk, Q4_1::kMins, j), x.sum[m * nb + b], off[j]);
        }
      }
      for (int j = 0; j < s.columns; ++j) y[static_cast<size_t>(m) * ystride + j] = acc[j] + off[j];
    }
  }
};

// Each output of the call, y[m, j] = acc, acc running through the blocks of K in order:
// add(m, j, b, block's bytes, acc) adds block b's terms.
template <typename Format, typename Add>
void EachOutput(const TileStep& s, const RowGroup& g, int k, float* y, size_t ystride, Add add) {
  for (int m = 0; m < g.rows; ++m) {
    for (int j = 0; j < s.columns; ++j) {
      float acc = 0.0f;
      for (int b = 0; b < k / kBlock; ++b) add(m, j, b, s.at + static_cast<size_t>(b) * Format::kBlockBytes, acc);
      y[static_cast<size_t>(m) * ystride + j] = acc;
    }
  }
}

// float activations (accuracy_level 0, the build's layout checks): y = sum_k x * (d * q + mn), k in order.
struct Q4_1Float : OneTileMicro {
  RowGroups Groups(int rows) const { return {rows}; }
  void Run(const TileStep& s, const RowGroup& g, const FloatRows& x, float* y, size_t ystride) const {
    EachOutput<Q4_1>(s, g, x.k, y, ystride, [&](int m, int j, int b, const uint8_t* blk, float& acc) {
      const float* xb = x.x + static_cast<size_t>(m) * x.k + b * kBlock;
      const float d = HalfAt(blk, Q4_1::kScales, j), mn = HalfAt(blk, Q4_1::kMins, j);
      for (int i = 0; i < Q4_1::kGroups; ++i) {
        for (int r = 0; r < kWordBytes; ++r) {
          const uint8_t byte = blk[i * Q4_1::kGroupBytes + j * kWordBytes + r];
          acc += xb[Q4_1::kGroupRows * i + r] * (d * (byte & 0x0f) + mn);
          acc += xb[Q4_1::kGroupRows * i + Q4_1::kHighRows + r] * (d * (byte >> 4) + mn);
        }
      }
    });
  }
};

// ---- Q8_0 ---------------------------------------------------------------------------------------

// acc += float(dot_b) * (d * dx_b) per block, the dot over the block's codes of column j and the
// row's activations (int8 or int16); kFused: one fused multiply-add (int16), else multiply then add.
template <typename Rows, bool kFused>
struct Q8Blocks : OneTileMicro {
  RowGroups Groups(int rows) const { return {kFused ? rows : kRowGroup}; }
  void Run(const TileStep& s, const RowGroup& g, const Rows& x, float* y, size_t ystride) const {
    const int nb = x.k / kBlock;
    EachOutput<Q8_0>(s, g, x.k, y, ystride, [&](int m, int j, int b, const uint8_t* blk, float& acc) {
      const auto* xb = x.q + static_cast<size_t>(m) * x.k + b * kBlock;
      int32_t dot = 0;
      for (int grp = 0; grp < Q8_0::kGroups; ++grp)
        for (int r = 0; r < kWordBytes; ++r) dot += Q8Code(blk, grp, j, r) * xb[Q8_0::kGroupRows * grp + r];
      const float scale = HalfAt(blk, Q8_0::kScales, j) * x.scale[m * nb + b];
      if (kFused) acc = std::fma(static_cast<float>(dot), scale, acc);
      else acc += static_cast<float>(dot) * scale;
    });
  }
};

// float activations: y = sum_k x * (d * q), k in order.
struct Q8Float : OneTileMicro {
  RowGroups Groups(int rows) const { return {rows}; }
  void Run(const TileStep& s, const RowGroup& g, const FloatRows& x, float* y, size_t ystride) const {
    EachOutput<Q8_0>(s, g, x.k, y, ystride, [&](int m, int j, int b, const uint8_t* blk, float& acc) {
      const float* xb = x.x + static_cast<size_t>(m) * x.k + b * kBlock;
      const float d = HalfAt(blk, Q8_0::kScales, j);
      for (int grp = 0; grp < Q8_0::kGroups; ++grp)
        for (int r = 0; r < kWordBytes; ++r) acc += xb[Q8_0::kGroupRows * grp + r] * (d * Q8Code(blk, grp, j, r));
    });
  }
};

}  // namespace

// Every entry but I8PerChannel's (the avx512vnni level's alone).
void ScalarKernels(Kernels* k) {
  *k = Kernels{QuantizeI8, QuantizeI16, Linear<Q4_1, Q4_1Int8, Int8Rows>, Linear<Q4_1, Q4_1Float, FloatRows>,
               Linear<Q8_0, Q8Blocks<Int8Rows, false>, Int8Rows>, Linear<Q8_0, Q8Blocks<Int16Rows, true>, Int16Rows>,
               Linear<Q8_0, Q8Float, FloatRows>};
}

}  // namespace kiln
