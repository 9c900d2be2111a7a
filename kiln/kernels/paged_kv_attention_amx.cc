// The amx level's kiln.PagedAttentionU8 / F16 (paged_kv_attention.h): a task of many queries (a
// prefill's run of tokens) on AMX-BF16 tiles, where one TDPBF16PS multiplies 16 queries by 16 keys
// over 32 dimensions. Decodes of one token keep the avx512 vector kernel (a task there has only the
// group's few query heads: a tile's 16 rows would stand mostly empty, and the cache's bytes set the
// pace). build.py compiles this file with the amx level's flags; microkernels_amx.cc installs it once
// Linux has granted the tile state.
//
// A task (one sequence, one kv head, up to kKvTileQueries query vectors):
//   1. its span's keys and values, widened from the cache to bf16 once, in the layouts TDPBF16PS reads
//      as its second operand: a pair of consecutive k in each 32-bit word (keys: two dimensions of a
//      key; values: one dimension of two keys). The call's own tokens too, as the cache holds them
//      (paged_kv_attention.h says why).
//   2. per 16 queries: their rows times every key (tiles), the scores into memory. Queries and keys
//      are each split into a bf16 value and the bf16 of what its rounding left out, and three products
//      sum them: the scores are f32's to about 2^-16, as the vector kernel's are.
//   3. the softmax per query on vectors, in f32 over the whole span at once (no running rescale: the
//      scores of 16 queries over a span are a few KiB to a few hundred), the weights rounded to bf16;
//   4. the weights times the values (bf16) on tiles, the sums in f32, divided by the weights' total.
// So the weights and the values carry bf16's 8 bits (an error of at most 2^-8 of the largest value,
// unbiased), and everything else f32's.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "kernels.h"
#include "paged_kv_attention.h"

namespace kiln {
namespace {

#include "attention_math.h"     // Lanes, Load, ExpLanes (inside this anonymous namespace)

constexpr int kLanes = 16;

#include "kv_elements.h"        // U8Codes, F16Values

typedef uint32_t Words __attribute__((vector_size(64)));
typedef uint16_t Halves __attribute__((vector_size(32)));

constexpr int kTileRows = 16;                 // queries per tile row group; keys per score tile
constexpr int kPairK = 32;                    // k per tile product (bf16 pairs in 64-byte rows)
constexpr int kTileBytes = 64;                // every tile here is 16 rows of 64 bytes
constexpr int kWordsPerTile = kTileRows * kLanes;
const Lanes kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// The tile registers (GCC's _tile_* paste the numbers into the instruction's text: macros).
#define kOut0 0       // weights x values: 16 queries x 16 dimensions each, four at a time
#define kOut1 1
#define kOut2 2
#define kOut3 3
#define kScore0 0     // queries x keys: 16 x 16, two at a time (the same registers, another phase)
#define kScore1 1
#define kRows 4       // queries (bf16 rows) or their weights
#define kPair0 5      // keys or values in pairs; two, so a load need not wait for the last product
#define kPair1 6
#define kRowsLow 7    // what the queries' bf16 rows leave out (the scores' second product)

void LoadTileShapes() {
  TileConfig c;
  for (int t = 0; t <= kRowsLow; ++t) {
    c.rows[t] = kTileRows;
    c.colsb[t] = kTileBytes;
  }
  _tile_loadconfig(&c);
}

// x rounded to bf16 (to nearest, ties to even), kept in each word's upper half.
KILN_INLINE Words Bf16High(Lanes x) {
  Words b;
  std::memcpy(&b, &x, sizeof b);
  return (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
}

// One word per lane: lo's bf16 in the lower half, hi's in the upper (TDPBF16PS's pair of k).
KILN_INLINE Words Pair(Lanes lo, Lanes hi) { return (Bf16High(lo) >> 16) | Bf16High(hi); }

KILN_INLINE void StoreWords(uint32_t* at, Words w) { std::memcpy(at, &w, sizeof w); }

KILN_INLINE Lanes Rounded(Lanes x) {
  const Words high = Bf16High(x);
  Lanes r;
  std::memcpy(&r, &high, sizeof r);
  return r;
}

// The pair (lo, hi) as two bf16 pairs: the values rounded, and what the rounding left out (their sum
// carries 16 bits of each mantissa: the scores' products come out as f32's to about 2^-16).
KILN_INLINE void StoreSplit(uint32_t* high, uint32_t* low, Lanes lo, Lanes hi) {
  StoreWords(high, Pair(lo, hi));
  StoreWords(low, Pair(lo - Rounded(lo), hi - Rounded(hi)));
}

// 16 floats as 16 bf16 in a row; returns the rounded values as floats.
KILN_INLINE Lanes StoreBf16(uint16_t* at, Lanes x) {
  const Words high = Bf16High(x);
  const Halves h = __builtin_convertvector(high >> 16, Halves);
  std::memcpy(at, &h, sizeof h);
  Lanes rounded;
  std::memcpy(&rounded, &high, sizeof rounded);
  return rounded;
}

// A task's widened span: keys and values of `keys` positions from `base` (a block's start), padded
// with zeros to a multiple of 32.
struct Widened {
  int64_t base;
  int keys, padded;
  uint32_t* key_tiles;      // [padded / 16][hd / 32] tiles: row r = dimensions 2r, 2r+1 of 16 keys
  uint32_t* key_low;        // the same places: what the keys' rounding to bf16 left out
  uint32_t* value_tiles;    // [padded / 32][hd / 16] tiles: row r = keys 2r, 2r+1 of 16 dimensions
};

template <typename F>
KILN_INLINE Lanes KeyDimension(const Segment& seg, int bs, int h16, int d) {
  Lanes x = F::Keys(seg.codes, bs, d, h16);
  if constexpr (F::kAffine) x = x * Load(seg.scale + h16) + Load(seg.minimum + h16);
  return x;
}

template <typename F>
KILN_INLINE Lanes ValueRow(const Segment& seg, int hd, int slot, int c) {
  Lanes x = F::Values(seg.codes, hd, slot, c);
  if constexpr (F::kAffine) x = x * seg.scale[slot] + seg.minimum[slot];
  return x;
}

// 16 keys from `first` (inside one block) as the cache holds them, the lanes from `valid` on zero.
template <typename F>
void WidenKeyGroup(const PackedAttention& s, const uint8_t* key_cache, const uint8_t* value_cache,
                   const PackedSequence& seq, int g, int64_t first, int group, int valid, Widened& w) {
  const int bs = s.block_size, hd = s.head_dim;
  const int64_t block = seq.blocks[first / bs];
  const int h16 = static_cast<int>(first % bs);
  const Segment keys = SegmentOf(s, key_cache, block, g, F::kFormat);
  const Segment values = SegmentOf(s, value_cache, block, g, F::kFormat);
  const Lanes keep = kIota < static_cast<float>(valid) ? Lanes{} + 1.f : Lanes{};
  const size_t at_group = static_cast<size_t>(group) * (hd / kPairK) * kWordsPerTile;
  uint32_t *kt = w.key_tiles + at_group, *kl = w.key_low + at_group;
  for (int d = 0; d < hd; d += 2)     // tile d / 32, row (d % 32) / 2
    StoreSplit(kt + static_cast<size_t>(d / 2) * kLanes, kl + static_cast<size_t>(d / 2) * kLanes,
               KeyDimension<F>(keys, bs, h16, d) * keep, KeyDimension<F>(keys, bs, h16, d + 1) * keep);
  // values: this group is rows 8 (group % 2) .. of its 32 keys' tiles
  const auto value = [&](int lane, int c) { return lane < valid ? ValueRow<F>(values, hd, h16 + lane, c) : Lanes{}; };
  uint32_t* vt = w.value_tiles + static_cast<size_t>(group / 2) * (hd / kLanes) * kWordsPerTile;
  for (int pair = 0; pair < kLanes / 2; ++pair) {
    const int row = (group % 2) * (kLanes / 2) + pair;
    for (int c = 0; c < hd; c += kLanes)
      StoreWords(vt + (static_cast<size_t>(c / kLanes) * kTileRows + row) * kLanes,
                 Pair(value(2 * pair, c), value(2 * pair + 1, c)));
  }
}

template <typename F>
void Widen(const PackedAttention& s, const uint8_t* key_cache, const uint8_t* value_cache, const PackedSequence& seq,
           int g, Widened& w) {
  const int hd = s.head_dim;
  for (int group = 0; group * kLanes < w.padded; ++group) {
    const int valid = w.keys - group * kLanes;
    if (valid > 0) {
      WidenKeyGroup<F>(s, key_cache, value_cache, seq, g, w.base + group * kLanes, group,
                       valid < kLanes ? valid : kLanes, w);
      continue;
    }
    // the padding's keys and values: zeros (a weight of 0 times them stays 0)
    const size_t at_group = static_cast<size_t>(group) * (hd / kPairK) * kWordsPerTile;
    std::memset(w.key_tiles + at_group, 0, sizeof(uint32_t) * (hd / kPairK) * kWordsPerTile);
    std::memset(w.key_low + at_group, 0, sizeof(uint32_t) * (hd / kPairK) * kWordsPerTile);
    uint32_t* vt = w.value_tiles + static_cast<size_t>(group / 2) * (hd / kLanes) * kWordsPerTile;
    for (int c = 0; c < hd / kLanes; ++c)
      std::memset(vt + (static_cast<size_t>(c) * kTileRows + (group % 2) * (kLanes / 2)) * kLanes, 0,
                  sizeof(uint32_t) * (kLanes / 2) * kLanes);
  }
}

// One query vector of the task: its bf16 row's place, the keys it sees, where its output goes.
struct TileQuery {
  int64_t first, last;
  float* out;
};

// scores[16][padded] = the row group's queries . every key (rows past the task's count are zeros),
// as high . high + low . high + high . low (the low . low product is below f32's precision anyway).
void Scores(const uint16_t* rows, const uint16_t* rows_low, int hd, const Widened& w, float* scores) {
  const size_t q_stride = static_cast<size_t>(hd) * sizeof(uint16_t), s_stride = w.padded * sizeof(float);
  const size_t per_group = static_cast<size_t>(hd / kPairK) * kWordsPerTile;
  for (int key = 0; key < w.padded; key += 2 * kLanes) {
    _tile_zero(kScore0);
    _tile_zero(kScore1);
    const size_t group0 = static_cast<size_t>(key / kLanes) * per_group;
    for (int c = 0; c < hd / kPairK; ++c) {
      const size_t tile = group0 + static_cast<size_t>(c) * kWordsPerTile;
      _tile_loadd(kRows, rows + c * kPairK, q_stride);
      _tile_loadd(kPair0, w.key_tiles + tile, kTileBytes);
      _tile_dpbf16ps(kScore0, kRows, kPair0);
      _tile_loadd(kPair1, w.key_tiles + tile + per_group, kTileBytes);
      _tile_dpbf16ps(kScore1, kRows, kPair1);
      _tile_loadd(kRowsLow, rows_low + c * kPairK, q_stride);
      _tile_dpbf16ps(kScore0, kRowsLow, kPair0);
      _tile_dpbf16ps(kScore1, kRowsLow, kPair1);
      _tile_loadd(kPair0, w.key_low + tile, kTileBytes);
      _tile_dpbf16ps(kScore0, kRows, kPair0);
      _tile_loadd(kPair1, w.key_low + tile + per_group, kTileBytes);
      _tile_dpbf16ps(kScore1, kRows, kPair1);
    }
    _tile_stored(kScore0, scores + key, s_stride);
    _tile_stored(kScore1, scores + key + kLanes, s_stride);
  }
}

// e^x for x <= 0: 2^n by VSCALEFPS, 2^f for |f| <= 1/2 by its series to the 4th power (relative
// error < 5e-5, far below the bf16 the weights are rounded to); 0 below 2^-125 and for -inf. NOTE: the
// cut is what keeps it fast: a result below 2^-126 is a denormal, which the CPU computes in microcode.
KILN_INLINE __m512 ExpToZero(__m512 x) {
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950409f));
  const __mmask16 kept = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.f), _CMP_GE_OQ);
  t = _mm512_max_ps(t, _mm512_set1_ps(-125.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 a = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471806f));
  __m512 poly = _mm512_fmadd_ps(a, _mm512_set1_ps(1.f / 24.f), _mm512_set1_ps(1.f / 6.f));
  poly = _mm512_fmadd_ps(poly, a, _mm512_set1_ps(0.5f));
  poly = _mm512_fmadd_ps(poly, a, _mm512_set1_ps(1.f));
  poly = _mm512_fmadd_ps(poly, a, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(kept, poly, n);
}

// Which of the 16 keys from i query q sees.
KILN_INLINE __mmask16 SeenKeys(const TileQuery& q, const Widened& w, int i) {
  const __m512 key = _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                   _mm512_set1_ps(static_cast<float>(w.base + i)));
  return _mm512_cmp_ps_mask(key, _mm512_set1_ps(static_cast<float>(q.first)), _CMP_GE_OQ) &
         _mm512_cmp_ps_mask(key, _mm512_set1_ps(static_cast<float>(q.last)), _CMP_LE_OQ);
}

// Softcap's tanh on the scaled scores in place (Gemma 2; rare, so plain).
void CapScores(const AttentionParams& p, float* scores, int i0, int i1) {
  for (int i = i0; i < i1; ++i) scores[i] = p.softcap * std::tanh(scores[i] * p.scale / p.softcap) / p.scale;
}

// Row j's scores into bf16 weights e^(score - largest), zero where the query does not see the key;
// returns 1 / their total (of the rounded weights, so the weights used sum to one). Only the 16-key
// groups holding the keys the query sees are read (the rest of its row is zeros), and only the first
// and last of those need a mask. The scale (> 0) applies after the largest is found.
float Weights(const AttentionParams& p, const TileQuery& q, const Widened& w, float* scores, uint16_t* weights) {
  const int i0 = static_cast<int>(q.first - w.base) / kLanes * kLanes;
  const int i1 = (static_cast<int>(q.last - w.base) / kLanes + 1) * kLanes;
  std::memset(weights, 0, sizeof(uint16_t) * i0);
  std::memset(weights + i1, 0, sizeof(uint16_t) * (w.padded - i1));
  if (p.softcap > 0.f) CapScores(p, scores, i0, i1);
  const __m512 none = _mm512_set1_ps(-INFINITY);
  __m512 most = none;
  for (int i = i0; i < i1; i += kLanes) {
    const __m512 x = _mm512_loadu_ps(scores + i);
    most = i == i0 || i + kLanes == i1 ? _mm512_mask_max_ps(most, SeenKeys(q, w, i), most, x) : _mm512_max_ps(most, x);
  }
  const __m512 scale = _mm512_set1_ps(p.scale);
  const __m512 shift = _mm512_set1_ps(-_mm512_reduce_max_ps(most) * p.scale);
  __m512 total = _mm512_setzero_ps();
  for (int i = i0; i < i1; i += kLanes) {
    __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(scores + i), scale, shift);
    if (i == i0 || i + kLanes == i1) x = _mm512_mask_blend_ps(SeenKeys(q, w, i), none, x);
    Lanes e;
    const __m512 ex = ExpToZero(x);
    std::memcpy(&e, &ex, sizeof e);
    const Lanes rounded = StoreBf16(weights + i, e);
    __m512 r;
    std::memcpy(&r, &rounded, sizeof r);
    total = _mm512_add_ps(total, r);
  }
  return 1.f / _mm512_reduce_add_ps(total);
}

// out rows = weights [16][padded] x values, 64 dimensions (four tiles) at a time.
void WeightedValues(const uint16_t* weights, int hd, const Widened& w, float* sums) {
  const size_t w_stride = w.padded * sizeof(uint16_t), o_stride = static_cast<size_t>(hd) * sizeof(float);
  const size_t per_chunk = static_cast<size_t>(hd / kLanes) * kWordsPerTile;
  for (int d0 = 0; d0 < hd; d0 += 4 * kLanes) {
    const int tiles = (hd - d0) / kLanes < 4 ? (hd - d0) / kLanes : 4;      // 2 or 4: hd is a multiple of 32
    _tile_zero(kOut0);
    _tile_zero(kOut1);
    _tile_zero(kOut2);
    _tile_zero(kOut3);
    for (int key = 0; key < w.padded; key += kPairK) {
      const uint32_t* chunk = w.value_tiles + static_cast<size_t>(key / kPairK) * per_chunk +
                              static_cast<size_t>(d0 / kLanes) * kWordsPerTile;
      _tile_loadd(kRows, weights + key, w_stride);
      _tile_loadd(kPair0, chunk, kTileBytes);
      _tile_dpbf16ps(kOut0, kRows, kPair0);
      _tile_loadd(kPair1, chunk + kWordsPerTile, kTileBytes);
      _tile_dpbf16ps(kOut1, kRows, kPair1);
      if (tiles == 4) {
        _tile_loadd(kPair0, chunk + 2 * kWordsPerTile, kTileBytes);
        _tile_dpbf16ps(kOut2, kRows, kPair0);
        _tile_loadd(kPair1, chunk + 3 * kWordsPerTile, kTileBytes);
        _tile_dpbf16ps(kOut3, kRows, kPair1);
      }
    }
    _tile_stored(kOut0, sums + d0, o_stride);
    _tile_stored(kOut1, sums + d0 + kLanes, o_stride);
    if (tiles == 4) {
      _tile_stored(kOut2, sums + d0 + 2 * kLanes, o_stride);
      _tile_stored(kOut3, sums + d0 + 3 * kLanes, o_stride);
    }
  }
}

template <typename F>
void AttendOnTiles(const PackedAttention& s, const AttentionParams& p, const float* q, const uint8_t* key_cache, const uint8_t* value_cache, const PackedSequence& seq, int g, int s0,
                   int s1, float* out) {
  const int hd = s.head_dim, group = s.heads / s.kv_heads, bs = s.block_size;
  const int count = (s1 - s0) * group;          // query j: token s0 + j / group, head g * group + j % group
  const int row_groups = (count + kTileRows - 1) / kTileRows;
  const int64_t lo = p.window > 0 && seq.past + s0 - p.window + 1 > 0 ? seq.past + s0 - p.window + 1 : 0;
  Widened w;
  w.base = lo / bs * bs;
  w.keys = static_cast<int>(seq.past + s1 - w.base);
  w.padded = (w.keys + kPairK - 1) / kPairK * kPairK;
  const size_t span_words = static_cast<size_t>(w.padded) * hd / 2;
  auto* span = static_cast<uint32_t*>(ScratchMemory(Scratch::kAttentionChunk, 3 * span_words * sizeof(uint32_t)));
  w.key_tiles = span;
  w.key_low = span + span_words;
  w.value_tiles = span + 2 * span_words;
  Widen<F>(s, key_cache, value_cache, seq, g, w);

  const size_t rows_bytes = static_cast<size_t>(row_groups) * kTileRows * hd * sizeof(uint16_t);
  const size_t scores_bytes = static_cast<size_t>(kTileRows) * w.padded * sizeof(float);
  auto* scratch = static_cast<uint8_t*>(ScratchMemory(
      Scratch::kAttention, 2 * rows_bytes + scores_bytes + static_cast<size_t>(kTileRows) * w.padded * sizeof(uint16_t)));
  auto* rows = reinterpret_cast<uint16_t*>(scratch);
  auto* rows_low = reinterpret_cast<uint16_t*>(scratch + rows_bytes);
  auto* scores = reinterpret_cast<float*>(scratch + 2 * rows_bytes);
  auto* weights = reinterpret_cast<uint16_t*>(scratch + 2 * rows_bytes + scores_bytes);
  TileQuery qs[kKvTileQueries];
  for (int j = 0; j < row_groups * kTileRows; ++j) {
    uint16_t *row = rows + static_cast<size_t>(j) * hd, *row_low = rows_low + static_cast<size_t>(j) * hd;
    if (j >= count) {
      std::memset(row, 0, sizeof(uint16_t) * hd);
      std::memset(row_low, 0, sizeof(uint16_t) * hd);
      continue;
    }
    const size_t at = (static_cast<size_t>(seq.begin) + s0 + j / group) * s.heads * hd + (g * group + j % group) * hd;
    for (int d = 0; d < hd; d += kLanes) {
      const Lanes x = Load(q + at + d);
      StoreBf16(row_low + d, x - StoreBf16(row + d, x));
    }
    const int64_t last = seq.past + s0 + j / group;
    qs[j] = {p.window > 0 && last - p.window + 1 > 0 ? last - p.window + 1 : 0, last, out + at};
  }
  LoadTileShapes();
  alignas(64) float sums[kTileRows * kMaxHeadDim];
  for (int r = 0; r < row_groups; ++r) {
    const size_t first_row = static_cast<size_t>(r) * kTileRows * hd;
    Scores(rows + first_row, rows_low + first_row, hd, w, scores);
    float inverse[kTileRows];
    for (int j = 0; j < kTileRows; ++j) {
      const int query = r * kTileRows + j;
      uint16_t* row_weights = weights + static_cast<size_t>(j) * w.padded;
      if (query >= count) {
        std::memset(row_weights, 0, sizeof(uint16_t) * w.padded);
        continue;
      }
      inverse[j] = Weights(p, qs[query], w, scores + static_cast<size_t>(j) * w.padded, row_weights);
    }
    WeightedValues(weights, hd, w, sums);
    for (int j = 0; j < kTileRows && r * kTileRows + j < count; ++j)
      for (int d = 0; d < hd; d += kLanes) {
        const Lanes x = Load(sums + static_cast<size_t>(j) * hd + d) * inverse[j];
        std::memcpy(qs[r * kTileRows + j].out + d, &x, sizeof x);
      }
  }
  _tile_release();
}

#undef kOut0
#undef kOut1
#undef kOut2
#undef kOut3
#undef kScore0
#undef kScore1
#undef kRows
#undef kPair0
#undef kPair1
#undef kRowsLow

AttendKvFn vector_attend = nullptr;

void AttendKvAmx(KvFormat f, const PackedAttention& s, const AttentionParams& p, const float* q, const float* k,
                 const float* v, const uint8_t* key_cache, const uint8_t* value_cache, const PackedSequence& seq,
                 int g, int s0, int s1, float* out) {
  const bool many_queries = seq.count > 1 && (s1 - s0) * (s.heads / s.kv_heads) > 4;
  if (!many_queries || s.head_dim % kPairK != 0)
    return vector_attend(f, s, p, q, k, v, key_cache, value_cache, seq, g, s0, s1, out);
  if (f == KvFormat::kU8) return AttendOnTiles<U8Codes>(s, p, q, key_cache, value_cache, seq, g, s0, s1, out);
  if (f == KvFormat::kF16) AttendOnTiles<F16Values>(s, p, q, key_cache, value_cache, seq, g, s0, s1, out);
}

int TileTaskQueries(int head_dim) { return head_dim % kPairK == 0 ? kKvTileQueries : kKvMaxQueries; }

}  // namespace

void AttendKvOnTiles(Kernels* k) {
  vector_attend = k->attend_kv;
  k->attend_kv = AttendKvAmx;
  k->kv_task_queries = TileTaskQueries;
}

}  // namespace kiln
