// isa.h's probe: __builtin_cpu_supports, read once, and the KILN_MAX_ISA cap. Compiled for plain x86-64.
#include "isa.h"

#include <cstdlib>
#include <cstring>

namespace kiln {

namespace {

constexpr const char* kNames[] = {"scalar", "avx2", "avx512", "avx512vnni", "amx"};

Isa Detected() {
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
    return Isa::kScalar;
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")))
    return Isa::kAvx2;
  if (!__builtin_cpu_supports("avx512vnni")) return Isa::kAvx512;
  if (!(__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && __builtin_cpu_supports("amx-bf16")))
    return Isa::kAvx512Vnni;
  return Isa::kAmx;
}

}  // namespace

const char* IsaName(Isa isa) { return kNames[static_cast<int>(isa)]; }

Isa HostIsa() {
  static const Isa best = Detected();
  const char* cap = std::getenv("KILN_MAX_ISA");
  if (cap == nullptr) return best;
  for (int level = 0; level < static_cast<int>(best); ++level)
    if (std::strcmp(cap, kNames[level]) == 0) return static_cast<Isa>(level);
  return best;
}

}  // namespace kiln

extern "C" __attribute__((visibility("default"))) const char* kiln_isa() { return kiln::IsaName(kiln::HostIsa()); }
