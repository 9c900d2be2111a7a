// The one probe of the CPU every kernel of the library dispatches on: the instruction-set levels
// kiln tells apart, lowest first, each requiring the flags of every level below it. The same levels
// and flags as kiln/contract/cpu.py's probe (ISA_LEVELS), which the build's choices read:
//     scalar       plain x86-64
//     avx2         avx2, fma, f16c
//     avx512       avx512f, avx512bw, avx512dq, avx512vl
//     avx512vnni   avx512vnni
//     amx          amx-tile, amx-int8, amx-bf16
// The environment variable KILN_MAX_ISA (one of the names) caps the level, as oneDNN's
// ONEDNN_MAX_CPU_ISA does; it can lower what a CPU runs, never raise it. An unknown value caps nothing.
#pragma once

namespace kiln {

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kAmx = 4 };

// This CPU's level (its flags read once per process) capped by KILN_MAX_ISA, read at each call: a
// kernel takes its level when it is created, so a test can lower it between sessions.
Isa HostIsa();
const char* IsaName(Isa isa);

}  // namespace kiln

// The level's name ("scalar" .. "amx"), for ctypes: kiln.engines.ort.native.isa() reads it.
extern "C" const char* kiln_isa();
