// What both amx-level files (microkernels_amx.cc, paged_kv_attention_amx.cc) hand LDTILECFG. A type
// only: nothing here is a symbol, so it may sit in either file's anonymous namespace.
#pragma once

#include <cstdint>

// LDTILECFG's 64-byte operand, palette 1: each tile's rows and bytes per row (0 x 0: unused).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
