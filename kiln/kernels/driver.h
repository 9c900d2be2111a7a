// The tile driver: the one loop every linear of the library runs, templated on the weight's layout
// (formats.h), the activations' type (kernels.h: Int8Rows, Int16Rows, FloatRows, U8Rows) and the
// micro-kernel. It walks the tiles of a range in steps (one or a few tiles) and the rows in groups,
// and hands each micro-kernel call its tiles, its rows of x and where its part of y starts. A
// micro-kernel lives in a per-level file (microkernels_<level>.cc) and says:
//     int TilesPerStep(int rows)        tiles per call (1, or 2 and 3 where tiles share a pass over x)
//     RowGroups Groups(int rows)        rows per call
//     void Prepare(const TileStep&)     once per step, before its row groups (e.g. widen the codes)
//     void Run(const TileStep&, const RowGroup&, const Rows& x, float* y, size_t ystride)
// A level's micro-kernel is such a struct in that level's own file (AMX's, on tiles of its own, in
// microkernels_amx.cc); the driver and the op libraries do not change (dispatch.cc).
#pragma once

#include <cstddef>
#include <cstdint>

#include "formats.h"

namespace kiln {

// Rows per micro-kernel call: at most `most`, filled in turn, or (even) split as evenly as that allows.
// rows_outer: each row group walks all the tiles before the next group starts, so the group's
// activations stay in L1 and the weights stream past them (the default, tiles outer, keeps a step's
// weights in L1 and streams the rows: better where the rows are few, their reload cheap). Rows outer
// calls Prepare once per step and row group, so it suits a micro-kernel with nothing to prepare.
struct RowGroups {
  int most;
  bool even = false;
  bool rows_outer = false;
};

// The tiles of one call: `count` tiles from `first`, their bytes one after another from `at`;
// `columns` of their 16 * count columns are real. `next`: the next step's bytes, where the range has
// one (what a micro-kernel may prefetch). `rows`: all the rows the driver was given.
struct TileStep {
  int first, count, columns, rows;
  const uint8_t* at;
  size_t tile_bytes;
  const uint8_t* next;
  size_t next_bytes;
  int Columns(int i) const {            // real columns of the step's tile i
    const int c = columns - i * kTileColumns;
    return c < kTileColumns ? c : kTileColumns;
  }
};

// The rows of one call: `rows` from `first`; group `index` of `count` in the step.
struct RowGroup {
  int first, rows, index, count;
};

// A micro-kernel of one tile per call and nothing to prepare.
struct OneTileMicro {
  int TilesPerStep(int) const { return 1; }
  void Prepare(const TileStep&) {}
};

// y[m, 16 t ..] for rows m in [0, rows) and tiles t in [t0, t1) of w (K = x.k, N = n columns), y's
// rows ystride apart.
template <typename Format, typename Rows, typename Micro>
void DriveTiles(Micro& micro, const Rows& x, int rows, const uint8_t* w, int n, int t0, int t1, float* y,
                size_t ystride) {
  if (rows <= 0) return;
  const size_t tile_bytes = Format::TileBytes(x.k);
  const int per_step = micro.TilesPerStep(rows);
  const RowGroups groups = micro.Groups(rows);
  const int count = (rows + groups.most - 1) / groups.most;
  const auto step_at = [&](int t) {
    const int tiles = t1 - t < per_step ? t1 - t : per_step;
    const int end = n < (t + tiles) * kTileColumns ? n : (t + tiles) * kTileColumns;
    const int after = t1 - t - tiles < per_step ? t1 - t - tiles : per_step;       // the next step's tiles
    return TileStep{t, tiles, end - t * kTileColumns, rows, w + t * tile_bytes, tile_bytes,
                    after > 0 ? w + (t + tiles) * tile_bytes : nullptr, after * tile_bytes};
  };
  const auto group_rows = [&](int i, int m) {
    return groups.even ? rows / count + (i < rows % count ? 1 : 0) : (rows - m < groups.most ? rows - m : groups.most);
  };
  const auto run = [&](const TileStep& step, int i, int m, int r) {
    micro.Run(step, RowGroup{m, r, i, count}, x.From(m), y + m * ystride + static_cast<size_t>(step.first) * kTileColumns,
              ystride);
  };
  if (groups.rows_outer) {
    for (int i = 0, m = 0; m < rows; ++i) {
      const int r = group_rows(i, m);
      for (int t = t0; t < t1; t += per_step) {
        const TileStep step = step_at(t);
        micro.Prepare(step);
        run(step, i, m, r);
      }
      m += r;
    }
    return;
  }
  for (int t = t0; t < t1; t += per_step) {
    const TileStep step = step_at(t);
    micro.Prepare(step);
    for (int i = 0, m = 0; m < rows; ++i) {
      const int r = group_rows(i, m);
      run(step, i, m, r);
      m += r;
    }
  }
}

// The table's entry for a linear (kernels.h's LinearFn): a default micro-kernel over y of stride n.
template <typename Format, typename Micro, typename Rows>
void Linear(const Rows& x, int rows, const uint8_t* w, int n, int t0, int t1, float* y) {
  Micro micro;
  DriveTiles<Format>(micro, x, rows, w, n, t0, t1, y, n);
}

}  // namespace kiln
