// The amx level's micro-kernels (AMX-TILE, AMX-INT8 and AMX-BF16, and the avx512vnni level's flags;
// build.py compiles this file with those): I8PerChannel's linears (the OpenVINO extension's kiln.LinearI8 and
// kiln.GateUpI8) on tiles, where one TDPBUSD multiplies 16 rows by 16 columns over 64 k, 16,384
// multiply-adds where vpdpbusd does 64. Few rows (one stream's decode) keep the avx512vnni kernels: a
// tile product costs the same for 1 row as for 16, and there the weights' bytes set the pace anyway.
//
// I8PerChannel's panel is already the tile layout TDPBUSD reads for its second operand: 16 steps of
// 4 k (64 bytes each, byte j*4 + r = q[4s + r, j]) are one 16 x 64-byte tile, 1 KiB contiguous. The
// activations' u8 rows are the first operand as they are (rows `stride` apart). K past the last whole
// 64 (a K4 that is not a multiple of 16) is summed on vpdpbusd after the tiles are stored.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "driver.h"
#include "amx_tiles.h"
#include "kernels.h"
#include "swiglu.h"
#include "u8s8.h"

namespace kiln {
namespace {

constexpr int kTileRows = 16;                                      // rows of an activation tile (and its sums)
constexpr int kCallRows = 2 * kTileRows;                            // rows per call: two activation tiles
constexpr int kTileSteps = 16;                                      // I8PerChannel steps (4 k) per weight tile
constexpr int kTileK = kTileSteps * I8PerChannel::kStepRows;       // 64 k per tile product
constexpr size_t kWeightTileBytes = kTileSteps * I8PerChannel::kStepBytes;   // 1 KiB
constexpr int kSumColumns = 2 * kTileColumns;                       // a row of the call's int32 sums
constexpr size_t kSumStride = kSumColumns * sizeof(int32_t);
// Below this many rows a call takes the avx512vnni kernels (the file's header says why).
constexpr int kMinTileRows = 4;

// Linux hands a process AMX tile state only when asked (arch/x86/include/uapi/asm/prctl.h); a tile
// instruction before that faults. Asked once; the answer holds for every thread of the process.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

bool TilesGranted() {
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// The tile registers: sums [rows 0-15 | 16-31] x [first | second weight tile], the two activation
// tiles, the two weight tiles. GCC's _tile_* paste their register numbers into the instruction's text,
// so they are macros that expand to digits.
#define kSum00 0
#define kSum01 1
#define kSum10 2
#define kSum11 3
#define kRows0 4
#define kRows1 5
#define kWeights0 6
#define kWeights1 7

// The tile shapes for a call of `rows` rows, loaded when they differ from the last call's in this
// linear (other code on the thread, oneDNN's among it, configures tiles too: each linear starts over).
class TileShapes {
 public:
  void For(int rows) {
    if (rows == loaded_) return;
    TileConfig c;
    const int first = rows < kTileRows ? rows : kTileRows, second = rows - first;
    Shape(c, kSum00, first, kTileColumns * sizeof(int32_t));
    Shape(c, kSum01, first, kTileColumns * sizeof(int32_t));
    Shape(c, kSum10, second, kTileColumns * sizeof(int32_t));
    Shape(c, kSum11, second, kTileColumns * sizeof(int32_t));
    Shape(c, kRows0, first, kTileK);
    Shape(c, kRows1, second, kTileK);
    Shape(c, kWeights0, kTileSteps, I8PerChannel::kStepBytes);
    Shape(c, kWeights1, kTileSteps, I8PerChannel::kStepBytes);
    _tile_loadconfig(&c);
    loaded_ = rows;
  }

 private:
  static void Shape(TileConfig& c, int tile, int rows, int bytes_per_row) {
    c.rows[tile] = static_cast<uint8_t>(rows);
    c.colsb[tile] = static_cast<uint16_t>(rows ? bytes_per_row : 0);      // an unused tile: 0 x 0
  }
  int loaded_ = 0;
};

// sums[r][j * 16 + c] = u8 row r of x . weight tile j's column c over the whole-tile part of K,
// j < 2 where w1 is given (else 1), rows r < 16 (or 32 where kTwoRowTiles).
template <bool kTwoRowTiles>
void TileSums(const uint8_t* xq, size_t stride, const int8_t* w0, const int8_t* w1, size_t tiles_k, int32_t* sums) {
  _tile_zero(kSum00);
  _tile_zero(kSum01);
  if constexpr (kTwoRowTiles) {
    _tile_zero(kSum10);
    _tile_zero(kSum11);
  }
  const uint8_t* second = xq + kTileRows * stride;
  for (size_t kt = 0; kt < tiles_k; ++kt) {
    // each load just before its first product: a tile is not renamed, so a load waits for the
    // products still reading the register it overwrites
    _tile_loadd(kRows0, xq + kt * kTileK, stride);
    _tile_loadd(kWeights0, w0 + kt * kWeightTileBytes, I8PerChannel::kStepBytes);
    _tile_dpbusd(kSum00, kRows0, kWeights0);
    if constexpr (kTwoRowTiles) {
      _tile_loadd(kRows1, second + kt * kTileK, stride);
      _tile_dpbusd(kSum10, kRows1, kWeights0);
    }
    if (w1 != nullptr) {
      _tile_loadd(kWeights1, w1 + kt * kWeightTileBytes, I8PerChannel::kStepBytes);
      _tile_dpbusd(kSum01, kRows0, kWeights1);
      if constexpr (kTwoRowTiles) _tile_dpbusd(kSum11, kRows1, kWeights1);
    }
  }
  _tile_stored(kSum00, sums, kSumStride);
  _tile_stored(kSum01, sums + kTileColumns, kSumStride);
  if constexpr (kTwoRowTiles) {
    _tile_stored(kSum10, sums + kTileRows * kSumColumns, kSumStride);
    _tile_stored(kSum11, sums + kTileRows * kSumColumns + kTileColumns, kSumStride);
  }
}

// The sums of a call's rows (< 32) against one or two weight panels (w1 may be null) over all of K:
// the tiles' part, then the steps past the last whole tile on vpdpbusd.
void RowSums(const U8Rows& x, int rows, const int8_t* w0, const int8_t* w1, size_t panel, TileShapes& shapes,
             int32_t* sums) {
  const size_t steps = panel / I8PerChannel::kStepBytes, tiles_k = steps / kTileSteps;
  shapes.For(rows);
  if (rows > kTileRows)
    TileSums<true>(x.q, x.stride, w0, w1, tiles_k, sums);
  else
    TileSums<false>(x.q, x.stride, w0, w1, tiles_k, sums);
  const int8_t* w[] = {w0, w1};
  for (size_t s = tiles_k * kTileSteps; s < steps; ++s)
    for (int r = 0; r < rows; ++r) {
      const __m512i xb = _mm512_set1_epi32(u8s8::Word(x.q + r * x.stride + s * I8PerChannel::kStepRows));
      for (int j = 0; j < (w1 != nullptr ? 2 : 1); ++j) {
        int32_t* at = sums + r * kSumColumns + j * kTileColumns;
        const __m512i wv = _mm512_loadu_si512(w[j] + s * I8PerChannel::kStepBytes);
        _mm512_storeu_si512(at, _mm512_dpbusd_epi32(_mm512_loadu_si512(at), xb, wv));
      }
    }
}

// y[r, 0..16) = (sums[r, 16 j ..] - the offset's share) * the columns' scales * row r's scale
void Dequantize(const int32_t* sums, int j, int rows, const U8Rows& x, const I8Linear& w, size_t column, float* y,
                size_t ldy) {
  const __m512i share = _mm512_cvtps_epi32(_mm512_loadu_ps(w.comp + column));
  const __m512 ws = _mm512_loadu_ps(w.scale + column);
  for (int r = 0; r < rows; ++r) {
    const __m512i exact = _mm512_sub_epi32(_mm512_loadu_si512(sums + r * kSumColumns + j * kTileColumns), share);
    _mm512_storeu_ps(y + r * ldy, _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(ws, _mm512_set1_ps(x.scale[r]))));
  }
}

// What both micro-kernels share: 32 rows a call (rows outer past one call: driver.h), nothing to
// prepare per step, and the tile shapes last loaded.
struct AmxMicro {
  TileShapes shapes;
  RowGroups Groups(int rows) const { return {kCallRows, true, rows > kCallRows}; }
  void Prepare(const TileStep&) {}
};

// One linear's tiles, two at a time.
struct AmxLinearMicro : AmxMicro {
  I8Linear w;
  explicit AmxLinearMicro(const I8Linear& linear) : w(linear) {}
  int TilesPerStep(int) const { return 2; }
  void Run(const TileStep& s, const RowGroup& g, const U8Rows& x, float* y, size_t ldy) {
    alignas(64) int32_t sums[kCallRows * kSumColumns];
    const int8_t* codes = reinterpret_cast<const int8_t*>(s.at);
    RowSums(x, g.rows, codes, s.count > 1 ? codes + s.tile_bytes : nullptr, s.tile_bytes, shapes, sums);
    for (int j = 0; j < s.count; ++j)
      Dequantize(sums, j, g.rows, x, w, static_cast<size_t>(s.first + j) * kTileColumns, y + j * kTileColumns, ldy);
  }
};

// The gate's and the up projection's same tile (their codes the same distance apart as their first
// tiles) as the two weight tiles of one call, then silu(gate) * up.
struct AmxGateUpMicro : AmxMicro {
  I8Linear gate, up;
  AmxGateUpMicro(const I8Linear& g, const I8Linear& u) : gate(g), up(u) {}
  int TilesPerStep(int) const { return 1; }
  void Run(const TileStep& s, const RowGroup& g, const U8Rows& x, float* y, size_t ldy) {
    alignas(64) int32_t sums[kCallRows * kSumColumns];
    alignas(64) float gs[kCallRows * kTileColumns], us[kCallRows * kTileColumns];
    const int8_t* codes = reinterpret_cast<const int8_t*>(s.at);
    RowSums(x, g.rows, codes, codes + (up.codes - gate.codes), s.tile_bytes, shapes, sums);
    const size_t column = static_cast<size_t>(s.first) * kTileColumns;
    Dequantize(sums, 0, g.rows, x, gate, column, gs, kTileColumns);
    Dequantize(sums, 1, g.rows, x, up, column, us, kTileColumns);
    SwiGlu(gs, us, kTileColumns, g.rows, 1, y, ldy);
  }
};

// The avx512vnni level's entries, which calls of few rows keep (AmxKernels saves them).
I8LinearFn vnni_linear = nullptr;
I8GateUpFn vnni_gate_up = nullptr;

void LinearI8(const U8Rows& x, int rows, const I8Linear& w, int t0, int t1, float* y, size_t ldy) {
  if (rows < kMinTileRows) return vnni_linear(x, rows, w, t0, t1, y, ldy);
  AmxLinearMicro micro(w);
  DriveTiles<I8PerChannel>(micro, x, rows, reinterpret_cast<const uint8_t*>(w.codes), t1 * kTileColumns, t0, t1, y, ldy);
  _tile_release();
}

void GateUpI8(const U8Rows& x, int rows, const I8Linear& gate, const I8Linear& up, int t0, int t1, float* y,
              size_t ldy) {
  if (rows < kMinTileRows) return vnni_gate_up(x, rows, gate, up, t0, t1, y, ldy);
  AmxGateUpMicro micro(gate, up);
  DriveTiles<I8PerChannel>(micro, x, rows, reinterpret_cast<const uint8_t*>(gate.codes), t1 * kTileColumns, t0, t1,
                           y, ldy);
  _tile_release();
}

#undef kSum00
#undef kSum01
#undef kSum10
#undef kSum11
#undef kRows0
#undef kRows1
#undef kWeights0
#undef kWeights1

}  // namespace

// Where Linux refuses the tile state, the table stays the avx512vnni level's.
void AmxKernels(Kernels* k) {
  if (!TilesGranted() || k->i8_linear == nullptr) return;
  vnni_linear = k->i8_linear;
  vnni_gate_up = k->i8_gate_up;
  k->i8_linear = LinearI8;
  k->i8_gate_up = GateUpI8;
  AttendKvOnTiles(k);
}

}  // namespace kiln
