// kiln's kernel library: what the op registrations call (kiln/engines/ort/native/*_op.cc, the ONNX
// Runtime custom ops; kiln/engines/openvino/native/linear_i8_op.cpp, the OpenVINO extension).
//
// Every linear is one tile driver (driver.h) over one packed layout (formats.h) with one micro-kernel
// per instruction-set level, each level's micro-kernels in a file compiled with that level's flags
// (microkernels_<level>.cc; kiln/kernels/build.py). KernelsFor(level) is the table a level runs: the
// scalar file's entries, overridden by each file up to the level (dispatch.cc). The AMX micro-kernels
// are one more such file, microkernels_amx.cc, and nothing else (dispatch.cc says how).
#pragma once

#include <cstddef>
#include <cstdint>

#include "formats.h"
#include "isa.h"
#include "paged_attention.h"
#include "paged_kv_attention.h"

namespace kiln {

// ---- activations, as the driver hands them to a micro-kernel (From(m): the same from row m on) ----

// Rows quantized per block of 32 to int8 (QuantizeI8Fn): scale dx = amax / 127 and the float block
// sum xs per block; qsum, each block's int8 sum, is the Q8_0 kernel's u8 x s8 offset (u8s8.h).
struct Int8Rows {
  const int8_t* q;
  const float* scale;
  const float* sum;
  const int32_t* qsum;
  int k;
  Int8Rows From(int m) const {
    const size_t blocks = static_cast<size_t>(m) * (k / kBlock);
    return {q + static_cast<size_t>(m) * k, scale + blocks, sum + blocks, qsum + blocks, k};
  }
};

// Rows quantized per block of 32 to int16 (QuantizeI16Fn): scale dx = amax / 32767 per block.
struct Int16Rows {
  const int16_t* q;
  const float* scale;
  int k;
  Int16Rows From(int m) const {
    return {q + static_cast<size_t>(m) * k, scale + static_cast<size_t>(m) * (k / kBlock), k};
  }
};

struct FloatRows {
  const float* x;
  int k;
  FloatRows From(int m) const { return {x + static_cast<size_t>(m) * k, k}; }
};

// Rows quantized whole to u8 for I8PerChannel (QuantizeU8Fn): one scale per row (absmax / 127), codes
// offset by 128 (u8s8.h), `stride` (K padded to a multiple of 4) apart, the padding codes 128.
struct U8Rows {
  const uint8_t* q;
  const float* scale;
  size_t stride;
  int k;
  U8Rows From(int m) const { return {q + static_cast<size_t>(m) * stride, scale + m, stride, k}; }
};

// One I8PerChannel linear's arrays (formats.h).
struct I8Linear {
  const int8_t* codes;
  const float* scale;
  const float* comp;
};

// ---- the table ------------------------------------------------------------------------------------

// One row of x [K] quantized per block of 32 (every level rounds x * (127 / amax) to the nearest
// int8, ties to even; only the block sums' addition order differs between levels).
using QuantizeI8Fn = void (*)(const float* x, int k, int8_t* xq, float* dx, float* xs);
// The same to int16, x * (32767 / amax).
using QuantizeI16Fn = void (*)(const float* x, int k, int16_t* xq, float* dx);
// One row of x [K], times its channels' factors sm, to u8 codes [Kp] offset by 128; returns its scale.
using QuantizeU8Fn = float (*)(const float* x, const float* sm, int k, int kp, uint8_t* q);

// y[m, 16 t0 .. min(16 t1, n)) for rows m in [0, rows), y's row stride n: tiles [t0, t1) of a packed
// weight w over K = x.k.
template <typename Rows>
using LinearFn = void (*)(const Rows& x, int rows, const uint8_t* w, int n, int t0, int t1, float* y);

// I8PerChannel: y[m, 16 t0 .. 16 t1) for rows [0, rows), y's row stride ldy.
using I8LinearFn = void (*)(const U8Rows& x, int rows, const I8Linear& w, int t0, int t1, float* y, size_t ldy);
// silu(x Wg^T) * (x Wu^T), the same tiles of both.
using I8GateUpFn = void (*)(const U8Rows& x, int rows, const I8Linear& gate, const I8Linear& up, int t0, int t1,
                            float* y, size_t ldy);

struct Kernels {
  QuantizeI8Fn quantize_i8 = nullptr;
  QuantizeI16Fn quantize_i16 = nullptr;
  LinearFn<Int8Rows> q4_1_i8 = nullptr;       // kiln.MatMulQ4Min, accuracy_level 4
  LinearFn<FloatRows> q4_1_f32 = nullptr;     //                    accuracy_level 0
  LinearFn<Int8Rows> q8_0_i8 = nullptr;       // kiln.MatMulQ8,     accuracy_level 4
  LinearFn<Int16Rows> q8_0_i16 = nullptr;     //                    accuracy_level 2
  LinearFn<FloatRows> q8_0_f32 = nullptr;     //                    accuracy_level 0
  AttendFn attend = nullptr;                  // kiln.PagedAttention
  AttendKvFn attend_kv = nullptr;             // kiln.PagedAttentionU8 / F16 (OpenVINO)
  KvTaskQueriesFn kv_task_queries = nullptr;  //   its tasks' size (null: kKvMaxQueries)
  KvDecodeFn decode_kv = nullptr;             //   its u8 decodes, several kv heads a task (null: attend_kv's)
  StoreTokenFn store_token = nullptr;         //   its cache rows
  // kiln.LinearI8 / kiln.GateUpI8 (OpenVINO): from avx512vnni up; null below
  QuantizeU8Fn quantize_u8 = nullptr;
  I8LinearFn i8_linear = nullptr;
  I8GateUpFn i8_gate_up = nullptr;
};

// The table a level runs (built once per level).
const Kernels& KernelsFor(Isa isa);

// Each level's file sets the entries it has (dispatch.cc calls them lowest first).
void ScalarKernels(Kernels* k);       // microkernels_scalar.cc
void Avx2Kernels(Kernels* k);         // microkernels_avx2.cc
void Avx512VnniKernels(Kernels* k);   // microkernels_avx512vnni.cc
void AmxKernels(Kernels* k);          // microkernels_amx.cc (weak in dispatch.cc)
// kiln.PagedAttentionU8 / F16's runs of many queries on AMX-BF16 tiles, the rest on the table's vector
// kernel (paged_kv_attention_amx.cc; AmxKernels calls it once Linux has granted the tile state).
void AttendKvOnTiles(Kernels* k);
// kiln.PagedAttentionU8's decodes on vpdpbusd over the cache's code words (paged_kv_decode_vnni.cc;
// Avx512VnniKernels calls it).
void AttendDecodesOnVnni(Kernels* k);

// Int8Rows' qsum: each block's sum of int8 codes, for `blocks` blocks of 32.
void BlockSums(const int8_t* xq, size_t blocks, int32_t* qsum);

// Per-thread scratch memory that lives as long as the thread, grown as asked and never shrunk: no
// allocation on the decode path. 64-byte aligned. Here, compiled for plain x86-64, because a
// per-level file must instantiate no std:: template (build.py's check says why).
enum class Scratch { kPanel, kPanelScales, kAttention, kAttentionChunk, kCount };
void* ScratchMemory(Scratch slot, size_t bytes);

}  // namespace kiln
