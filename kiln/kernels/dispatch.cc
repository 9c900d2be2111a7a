// Which micro-kernels a level runs, and what the per-level files must not build themselves (scratch
// memory). Compiled for plain x86-64.
#include <cstdlib>
#include <memory>

#include "kernels.h"

namespace kiln {

// NOTE: the AMX micro-kernels are one file, microkernels_amx.cc (build.py compiles each
// microkernels_<level>.cc with that level's flags, amx's among them): it defines AmxKernels, setting the
// entries it does better (I8PerChannel's linears on tiles), and the table below takes it up by itself.
// Weak, so the library links without the file. (Linux lets a process use AMX tiles once it has asked
// for them: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), which that file does.)
__attribute__((weak)) void AmxKernels(Kernels* k);

namespace {

Kernels Build(Isa isa) {
  Kernels k;
  ScalarKernels(&k);
  k.attend = AttendTaskScalar;
  k.attend_kv = AttendKvScalar;
  k.store_token = StoreTokenScalar;
  if (isa >= Isa::kAvx2) {
    Avx2Kernels(&k);
    k.attend = AttendTaskAvx2;
    k.attend_kv = AttendKvAvx2;
    k.store_token = StoreTokenAvx2;
  }
  // avx512 without VNNI: the avx2 linears (their vpdpbusd is the gain), AVX-512 attention
  if (isa >= Isa::kAvx512) {
    k.attend = AttendTaskAvx512;
    k.attend_kv = AttendKvAvx512;
    k.store_token = StoreTokenAvx512;
  }
  if (isa >= Isa::kAvx512Vnni) Avx512VnniKernels(&k);
  if (isa >= Isa::kAmx && AmxKernels != nullptr) AmxKernels(&k);
  return k;
}

}  // namespace

const Kernels& KernelsFor(Isa isa) {
  static const Kernels tables[] = {Build(Isa::kScalar), Build(Isa::kAvx2), Build(Isa::kAvx512),
                                   Build(Isa::kAvx512Vnni), Build(Isa::kAmx)};
  return tables[static_cast<int>(isa)];
}

void BlockSums(const int8_t* xq, size_t blocks, int32_t* qsum) {
  for (size_t i = 0; i < blocks; ++i) {
    int32_t sum = 0;
    for (int e = 0; e < kBlock; ++e) sum += xq[i * kBlock + e];
    qsum[i] = sum;
  }
}

void* ScratchMemory(Scratch slot, size_t bytes) {
  struct Region {
    std::unique_ptr<void, decltype(&std::free)> memory{nullptr, &std::free};
    size_t bytes = 0;
  };
  thread_local Region regions[static_cast<int>(Scratch::kCount)];
  Region& r = regions[static_cast<int>(slot)];
  if (bytes > r.bytes || r.memory == nullptr) {
    const size_t rounded = (bytes + 63) / 64 * 64 + 64;
    r.memory.reset(std::aligned_alloc(64, rounded));
    r.bytes = rounded;
  }
  return r.memory.get();
}

}  // namespace kiln

// Which level's I8PerChannel linears this process runs ("amx", "avx512vnni", or "none" below them):
// the amx level's table keeps the avx512vnni entries where its file is missing or Linux refused the
// tile state, so the level alone does not say. For the op library's Python side and its tests.
extern "C" __attribute__((visibility("default"))) const char* kiln_i8_linear_level() {
  using kiln::Isa;
  const kiln::Kernels& k = kiln::KernelsFor(kiln::HostIsa());
  if (k.i8_linear == nullptr) return "none";
  return k.i8_linear != kiln::KernelsFor(Isa::kAvx512Vnni).i8_linear ? "amx" : "avx512vnni";
}

// What kiln.PagedAttentionU8 / F16 compute a prefill's run of queries on in this process: "amx-bf16"
// (tiles: bf16 products, f32 sums) or "f32" (vectors throughout). For the Python side and its tests.
// NOTE: only the tiles' install (AttendKvOnTiles) sizes the tasks, so kv_task_queries says it ran, at
// whatever level KILN_MAX_ISA leaves.
extern "C" __attribute__((visibility("default"))) const char* kiln_kv_attention_level() {
  return kiln::KernelsFor(kiln::HostIsa()).kv_task_queries != nullptr ? "amx-bf16" : "f32";
}

// What kiln.PagedAttentionU8 computes a decode on in this process: "avx512vnni" (the query and each
// block's weights split into two signed bytes, integer products over the cache's code words) or "f32"
// (vectors throughout). For the Python side and its tests.
extern "C" __attribute__((visibility("default"))) const char* kiln_kv_decode_level() {
  return kiln::KernelsFor(kiln::HostIsa()).decode_kv != nullptr ? "avx512vnni" : "f32";
}
