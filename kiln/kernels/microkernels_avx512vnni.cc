// The avx512vnni level's micro-kernels (AVX-512 F/BW/DQ/VL with VNNI, and the avx2 level's flags;
// build.py compiles this file with those): the int8 products on vpdpbusd, 64 multiply-adds an
// instruction, for Q4_1 and Q8_0 (kiln.MatMulQ4Min, kiln.MatMulQ8) and I8PerChannel (the OpenVINO
// extension's kiln.LinearI8 and kiln.GateUpI8, which need this level).
#include <immintrin.h>

#include <cmath>

#include "driver.h"
#include "kernels.h"
#include "swiglu.h"
#include "u8s8.h"

namespace kiln {
namespace {

constexpr int kRowGroup = 4;    // rows that share one unpacking of a Q4_1 / Q8_0 tile's codes

// 16 columns' half floats at byte `offset` of a tile-block
inline __m512 Halves(const uint8_t* blk, int offset) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + offset)));
}

inline __mmask16 ColumnMask(int cols) {
  return cols >= kTileColumns ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
}

void QuantizeI8(const float* x, int k, int8_t* xq, float* dx, float* xs) {
  constexpr int kHalf = kBlock / 2;
  for (int b = 0; b < k / kBlock; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * kBlock), v1 = _mm512_loadu_ps(x + b * kBlock + kHalf);
    const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 inv = _mm512_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock + kHalf),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
    dx[b] = a / 127.0f;
    xs[b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
  }
}

// ---- Q4_1, int8 activations: the nibbles are u8 already -----------------------------------------
// NOTE: the rows' pointers come as arguments, not an Int8Rows, and y's stride as an int: a call is a
// few hundred cycles at 512 rows, and either change cost a few percent of the Q4_1 product there (GCC
// schedules the loop otherwise).
template <int R>
void Q4_1Rows(const int8_t* xq, const float* dx, const float* xs, int k, const uint8_t* tile, float* y, int ystride,
              int cols) {
  const int nb = k / kBlock;
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + static_cast<size_t>(b) * Q4_1::kBlockBytes;
    __m512i lo[Q4_1::kGroups], hi[Q4_1::kGroups];
    for (int i = 0; i < Q4_1::kGroups; ++i) {
      const __m512i v = _mm512_loadu_si512(blk + i * Q4_1::kGroupBytes);
      lo[i] = _mm512_and_si512(v, low);
      hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 d = Halves(blk, Q4_1::kScales), mn = Halves(blk, Q4_1::kMins);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq + static_cast<size_t>(r) * k + b * kBlock;
      // two chains of four, so the dependent vpdpbusd latency halves
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int i = 0; i < Q4_1::kGroups; ++i) {
        s0 = _mm512_dpbusd_epi32(s0, lo[i], _mm512_set1_epi32(u8s8::Word(xb + Q4_1::kGroupRows * i)));
        s1 = _mm512_dpbusd_epi32(s1, hi[i], _mm512_set1_epi32(u8s8::Word(xb + Q4_1::kGroupRows * i + Q4_1::kHighRows)));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
      off[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[r * nb + b]), off[r]);
    }
  }
  const __mmask16 mask = ColumnMask(cols);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + static_cast<size_t>(r) * ystride, mask, _mm512_add_ps(acc[r], off[r]));
}

// ---- Q8_0, int8 activations: the codes go in offset (u8s8.h), each sum starts at -128 x the block's activation sum
template <int R>
void Q8Rows(const int8_t* xq, const float* dx, const int32_t* qsum, int k, const uint8_t* tile, float* y,
            size_t ystride, int cols) {
  const int nb = k / kBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + static_cast<size_t>(b) * Q8_0::kBlockBytes;
    __m512i u[Q8_0::kGroups];
    for (int g = 0; g < Q8_0::kGroups; ++g) u[g] = u8s8::Offset(_mm512_loadu_si512(blk + g * Q8_0::kGroupBytes));
    const __m512 d = Halves(blk, Q8_0::kScales);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq + static_cast<size_t>(r) * k + b * kBlock;
      __m512i s0 = u8s8::Start(qsum[r * nb + b]), s1 = _mm512_setzero_si512();
      for (int g = 0; g < Q8_0::kGroups; g += 2) {
        s0 = _mm512_dpbusd_epi32(s0, u[g], _mm512_set1_epi32(u8s8::Word(xb + Q8_0::kGroupRows * g)));
        s1 = _mm512_dpbusd_epi32(s1, u[g + 1], _mm512_set1_epi32(u8s8::Word(xb + Q8_0::kGroupRows * (g + 1))));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
    }
  }
  const __mmask16 mask = ColumnMask(cols);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + static_cast<size_t>(r) * ystride, mask, acc[r]);
}

struct Q4_1Int8 : OneTileMicro {
  RowGroups Groups(int) const { return {kRowGroup}; }
  void Run(const TileStep& s, const RowGroup& g, const Int8Rows& x, float* y, size_t ystride) const {
    using Fn = void (*)(const int8_t*, const float*, const float*, int, const uint8_t*, float*, int, int);
    static constexpr Fn kFns[] = {Q4_1Rows<1>, Q4_1Rows<2>, Q4_1Rows<3>, Q4_1Rows<4>};
    kFns[g.rows - 1](x.q, x.scale, x.sum, x.k, s.at, y, static_cast<int>(ystride), s.columns);
  }
};

struct Q8Int8 : OneTileMicro {
  RowGroups Groups(int) const { return {kRowGroup}; }
  void Run(const TileStep& s, const RowGroup& g, const Int8Rows& x, float* y, size_t ystride) const {
    using Fn = void (*)(const int8_t*, const float*, const int32_t*, int, const uint8_t*, float*, size_t, int);
    static constexpr Fn kFns[] = {Q8Rows<1>, Q8Rows<2>, Q8Rows<3>, Q8Rows<4>};
    kFns[g.rows - 1](x.q, x.scale, x.qsum, x.k, s.at, y, ystride, s.columns);
  }
};

// ---- I8PerChannel (OpenVINO): u8 activations, one scale a row --------------------------------------
constexpr int kI8Rows = 8;                      // rows per call (I8Tile says why 8 x 3)
constexpr int kI8Tiles = 3;                     // 16-column tiles per call
constexpr int kI8StepColumns = kI8Tiles * kTileColumns;    // a row of the gate's and up's sums
constexpr size_t kPrefetchL1Bytes = 16384;      // a row group's share of the next step that goes to L1
constexpr int kCacheLine = 64;

// One row times its channels' smoothing factors, quantized: one scale (absmax / 127), codes offset
// by 128 into u8 (u8s8.h); padding codes 128 (their weights are zero).
float QuantizeU8(const float* x, const float* sm, int k, int kp, uint8_t* q) {
  constexpr int kLanes = 16;
  __m512 vmax = _mm512_setzero_ps();
  int i = 0;
  for (; i + kLanes <= k; i += kLanes)
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(sm + i))));
  float amax = _mm512_reduce_max_ps(vmax);
  for (; i < k; ++i) {
    const float a = std::fabs(x[i] * sm[i]);
    amax = amax < a ? a : amax;
  }
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  const __m512 inv = _mm512_set1_ps(1.f / s);
  for (i = 0; i + kLanes <= k; i += kLanes) {
    const __m512 xs = _mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(sm + i));
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(xs, inv), _MM_FROUND_TO_NEAREST_INT);
    const __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(r), _mm512_set1_epi32(u8s8::kOffset));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtusepi32_epi8(v));
  }
  for (; i < k; ++i) q[i] = static_cast<uint8_t>(std::nearbyint(x[i] * sm[i] / s) + static_cast<float>(u8s8::kOffset));
  for (i = k; i < kp; ++i) q[i] = u8s8::kOffset;
  return s;
}

// An R x (16 J) tile of y over all of K: up to 8 x 3 int32 sums in named accumulators (GCC keeps an
// array of vectors on the stack), 3 weight vectors and a broadcast per step of 4 k: 28 of the 32
// registers. Each weight vector serves 8 rows, so a tile is read from cache M / 8 times per call.
template <int R, int J>
void I8Tile(const U8Rows& x, const int8_t* w, size_t panel, const float* ws, const float* comp, float* y, size_t ldy,
            const int8_t* pf, size_t pf_lines) {
  const uint8_t* q = x.q;
  const size_t kp = x.stride, k4 = panel / I8PerChannel::kStepBytes;
  // pf: pf_lines cache lines of the next step, asked for a few per step of k, so the requests
  // spread over the multiply instead of queueing at its start; into L1 where they fit beside the
  // panel in use (at 32 rows, a quarter panel: calls measured faster than into L2), else into L2 (one
  // row group asks for a whole panel: into L1 it would evict the one being read)
  const size_t per_step = (pf_lines + k4 - 1) / k4;
  const bool into_l1 = pf_lines * kCacheLine <= kPrefetchL1Bytes;
  const int8_t* w0p = w;
  const int8_t* w1p = w + panel;
  const int8_t* w2p = w + 2 * panel;
  // NOTE: each sum starts at minus the offset's share (u8s8.h), so the int32 sum is exactly x . w.
  const __m512i c0 = u8s8::StartFromShare(_mm512_cvtps_epi32(_mm512_loadu_ps(comp)));
  __m512i c1 = c0, c2 = c0;
  if constexpr (J > 1) c1 = u8s8::StartFromShare(_mm512_cvtps_epi32(_mm512_loadu_ps(comp + kTileColumns)));
  if constexpr (J > 2) c2 = u8s8::StartFromShare(_mm512_cvtps_epi32(_mm512_loadu_ps(comp + 2 * kTileColumns)));
  __m512i a00 = c0, a01 = c1, a02 = c2, a10 = c0, a11 = c1, a12 = c2, a20 = c0, a21 = c1, a22 = c2,
          a30 = c0, a31 = c1, a32 = c2, a40 = c0, a41 = c1, a42 = c2, a50 = c0, a51 = c1, a52 = c2,
          a60 = c0, a61 = c1, a62 = c2, a70 = c0, a71 = c1, a72 = c2;
#define KILN_ROW(r)                                                                               \
  if constexpr (R > r) {                                                                          \
    const __m512i xb = _mm512_set1_epi32(u8s8::Word(q + r * kp + k4i * I8PerChannel::kStepRows));       \
    a##r##0 = _mm512_dpbusd_epi32(a##r##0, xb, w0);                                               \
    if constexpr (J > 1) a##r##1 = _mm512_dpbusd_epi32(a##r##1, xb, w1);                          \
    if constexpr (J > 2) a##r##2 = _mm512_dpbusd_epi32(a##r##2, xb, w2);                          \
  }
  for (size_t k4i = 0; k4i < k4; ++k4i) {
    const size_t last = pf_lines < (k4i + 1) * per_step ? pf_lines : (k4i + 1) * per_step;
    for (size_t l = k4i * per_step; l < last; ++l) {
      if (into_l1)
        _mm_prefetch(reinterpret_cast<const char*>(pf + l * kCacheLine), _MM_HINT_T0);
      else
        _mm_prefetch(reinterpret_cast<const char*>(pf + l * kCacheLine), _MM_HINT_T1);
    }
    const size_t at = k4i * I8PerChannel::kStepBytes;
    __m512i w0 = _mm512_loadu_si512(w0p + at), w1 = w0, w2 = w0;
    if constexpr (J > 1) w1 = _mm512_loadu_si512(w1p + at);
    if constexpr (J > 2) w2 = _mm512_loadu_si512(w2p + at);
    KILN_ROW(0) KILN_ROW(1) KILN_ROW(2) KILN_ROW(3) KILN_ROW(4) KILN_ROW(5) KILN_ROW(6) KILN_ROW(7)
  }
#undef KILN_ROW
  const __m512i a[kI8Rows][kI8Tiles] = {{a00, a01, a02}, {a10, a11, a12}, {a20, a21, a22}, {a30, a31, a32},
                                        {a40, a41, a42}, {a50, a51, a52}, {a60, a61, a62}, {a70, a71, a72}};
  for (int j = 0; j < J; ++j) {
    const __m512 vs = _mm512_loadu_ps(ws + j * kTileColumns);
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(y + r * ldy + j * kTileColumns,
                       _mm512_mul_ps(_mm512_cvtepi32_ps(a[r][j]), _mm512_mul_ps(vs, _mm512_set1_ps(x.scale[r]))));
  }
}

using I8TileFn = void (*)(const U8Rows&, const int8_t*, size_t, const float*, const float*, float*, size_t,
                          const int8_t*, size_t);

template <int R>
struct I8TilesOf {
  static constexpr I8TileFn kFns[kI8Tiles] = {I8Tile<R, 1>, I8Tile<R, 2>, I8Tile<R, 3>};
};

// [rows - 1][tiles - 1]
constexpr const I8TileFn* kI8Tile[kI8Rows] = {I8TilesOf<1>::kFns, I8TilesOf<2>::kFns, I8TilesOf<3>::kFns,
                                             I8TilesOf<4>::kFns, I8TilesOf<5>::kFns, I8TilesOf<6>::kFns,
                                             I8TilesOf<7>::kFns, I8TilesOf<8>::kFns};

// Part i of parts of the next step: the lines a row group asks for while it multiplies this one. The
// weights come from memory once per call (a model's linears exceed the caches), and the hardware
// prefetcher starts over at every step, since each row group reads the tiles again.
struct Prefetch {
  const int8_t* at;
  size_t lines;
};

Prefetch NextPart(const TileStep& s, const RowGroup& g) {
  if (s.next == nullptr) return {nullptr, 0};
  const size_t lines = (s.next_bytes + kCacheLine - 1) / kCacheLine;
  const size_t first = lines * g.index / g.count, last = lines * (g.index + 1) / g.count;
  return {reinterpret_cast<const int8_t*>(s.next) + first * kCacheLine, last - first};
}

// One linear's tiles, three at a time, eight rows at a time.
struct I8LinearMicro {
  I8Linear w;
  int TilesPerStep(int) const { return kI8Tiles; }
  RowGroups Groups(int) const { return {kI8Rows}; }
  void Prepare(const TileStep&) {}
  void Run(const TileStep& s, const RowGroup& g, const U8Rows& x, float* y, size_t ldy) const {
    const Prefetch pf = NextPart(s, g);
    const size_t column = static_cast<size_t>(s.first) * kTileColumns;
    kI8Tile[g.rows - 1][s.count - 1](x, reinterpret_cast<const int8_t*>(s.at), s.tile_bytes, w.scale + column,
                                     w.comp + column, y, ldy, pf.at, pf.lines);
  }
};

// The gate's and the up projection's same tiles (their codes the same distance apart as their
// first tiles), then silu(gate) * up.
struct I8GateUpMicro {
  I8Linear gate, up;
  int TilesPerStep(int) const { return kI8Tiles; }
  RowGroups Groups(int) const { return {kI8Rows}; }
  void Prepare(const TileStep&) {}
  void Run(const TileStep& s, const RowGroup& g, const U8Rows& x, float* y, size_t ldy) const {
    alignas(64) float gs[kI8Rows * kI8StepColumns], us[kI8Rows * kI8StepColumns];
    const size_t column = static_cast<size_t>(s.first) * kTileColumns;
    const ptrdiff_t apart = up.codes - gate.codes;
    const I8TileFn tile = kI8Tile[g.rows - 1][s.count - 1];
    const Prefetch pg = NextPart(s, g);
    const Prefetch pu{pg.at == nullptr ? nullptr : pg.at + apart, pg.lines};
    const int8_t* codes = reinterpret_cast<const int8_t*>(s.at);
    tile(x, codes, s.tile_bytes, gate.scale + column, gate.comp + column, gs, kI8StepColumns, pg.at, pg.lines);
    tile(x, codes + apart, s.tile_bytes, up.scale + column, up.comp + column, us, kI8StepColumns, pu.at, pu.lines);
    SwiGlu(gs, us, kI8StepColumns, g.rows, s.count, y, ldy);
  }
};

void LinearI8(const U8Rows& x, int rows, const I8Linear& w, int t0, int t1, float* y, size_t ldy) {
  I8LinearMicro micro{w};
  DriveTiles<I8PerChannel>(micro, x, rows, reinterpret_cast<const uint8_t*>(w.codes), t1 * kTileColumns, t0, t1, y, ldy);
}

void GateUpI8(const U8Rows& x, int rows, const I8Linear& gate, const I8Linear& up, int t0, int t1, float* y,
              size_t ldy) {
  I8GateUpMicro micro{gate, up};
  DriveTiles<I8PerChannel>(micro, x, rows, reinterpret_cast<const uint8_t*>(gate.codes), t1 * kTileColumns, t0, t1,
                           y, ldy);
}

}  // namespace

void Avx512VnniKernels(Kernels* k) {
  k->quantize_i8 = QuantizeI8;
  k->q4_1_i8 = Linear<Q4_1, Q4_1Int8, Int8Rows>;
  k->q8_0_i8 = Linear<Q8_0, Q8Int8, Int8Rows>;
  k->quantize_u8 = QuantizeU8;
  k->i8_linear = LinearI8;
  k->i8_gate_up = GateUpI8;
  AttendDecodesOnVnni(k);
}

}  // namespace kiln
