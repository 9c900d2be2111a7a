// kiln's ONNX Runtime custom-op library, over the C ABI only (ort_abi.h): the operators of the `kiln`
// domain. The two linears are here; PagedAttention is in paged_attention_op.cc.
//
//     Y[..., N] = MatMulQ4Min(X[..., K] float, B [ceil(N/16), K/32, 320] uint8)      attributes K, N
//     Y[..., N] = MatMulQ8   (X[..., K] float, B [ceil(N/16), K/32, 544] uint8)      (accuracy_level)
//
// accuracy_level: 4 int8 activations (the default), 2 int16 activations (MatMulQ8 only), 0 float.
//
// B is a tile layout of q4min_kernel.h: 4-bit codes with a half-float scale and minimum per block of
// 32 (Q4_1), or 8-bit codes with a half-float scale (Q8_0). The rows of X are quantized once per call;
// ONNX Runtime's intra-op pool then shares out the tiles (KernelContext_ParallelFor). Loaded with
// SessionOptions.register_custom_ops_library.
#include "op_library.h"
#include "q4min_kernel.h"

namespace {

using kiln_ops::Fail;
using kiln_ops::g_api;
using kiln_ops::Shape;
using kiln_ops::Status;

struct Kernel {
  int bits = 4;                  // 4: MatMulQ4Min, 8: MatMulQ8
  int64_t k = 0, n = 0;
  int64_t accuracy_level = 4;    // 4: int8 activations; 2: int16 (MatMulQ8); 0: float activations
  kiln_q4::Isa isa = kiln_q4::Isa::kScalar;
};

struct Job {
  const kiln_q4::Isa isa;
  int bits;
  const float* x;                 // set: float activations (accuracy_level 0)
  const int8_t* xq;
  const int16_t* xq16;            // set: int16 activations (MatMulQ8 at accuracy_level 2)
  const float *dx, *xs;
  const int32_t* xqsum;
  int rows, k, n, tiles, tiles_per_task;
  const uint8_t* w;
  float* y;
};

void RunTask(void* data, size_t index) {
  const Job& j = *static_cast<const Job*>(data);
  const int t0 = static_cast<int>(index) * j.tiles_per_task;
  const int t1 = t0 + j.tiles_per_task < j.tiles ? t0 + j.tiles_per_task : j.tiles;
  if (j.bits == 8) {
    if (j.x != nullptr) kiln_q4::MatMulTilesQ8Float(j.isa, j.x, j.rows, j.k, j.w, j.n, t0, t1, j.y);
    else if (j.xq16 != nullptr) kiln_q4::MatMulTilesQ8Int16(j.isa, j.xq16, j.dx, j.rows, j.k, j.w, j.n, t0, t1, j.y);
    else kiln_q4::MatMulTilesQ8(j.isa, j.xq, j.dx, j.xqsum, j.rows, j.k, j.w, j.n, t0, t1, j.y);
  } else if (j.x != nullptr) {
    kiln_q4::MatMulTilesFloat(j.x, j.rows, j.k, j.w, j.n, t0, t1, j.y);
  } else {
    kiln_q4::MatMulTiles(j.isa, j.xq, j.dx, j.xs, j.rows, j.k, j.w, j.n, t0, t1, j.y);
  }
}

Status* Compute(void* op_kernel, ort_abi::KernelContext* context) {
  const Kernel& kernel = *static_cast<const Kernel*>(op_kernel);
  const int k = static_cast<int>(kernel.k), n = static_cast<int>(kernel.n), nb = k / kiln_q4::kBlock;
  const int tiles = (n + kiln_q4::kTile - 1) / kiln_q4::kTile;
  const int block_bytes = kernel.bits == 8 ? kiln_q4::kTileBlockBytesQ8 : kiln_q4::kTileBlockBytes;
  const ort_abi::Value *x_value = nullptr, *w_value = nullptr;
  RETURN_IF_ERROR(g_api->GetInput(context, 0, &x_value));
  RETURN_IF_ERROR(g_api->GetInput(context, 1, &w_value));
  thread_local std::vector<int64_t> x_dims, w_dims, y_dims;     // NOTE: reused: no allocation per call
  RETURN_IF_ERROR(Shape(x_value, &x_dims));
  RETURN_IF_ERROR(Shape(w_value, &w_dims));
  if (x_dims.empty() || x_dims.back() != k)
    return Fail("X's last dimension must be K=" + std::to_string(k));
  if (w_dims.size() != 3 || w_dims[0] != tiles || w_dims[1] != nb || w_dims[2] != block_bytes)
    return Fail("B must be [" + std::to_string(tiles) + ", " + std::to_string(nb) + ", " +
                std::to_string(block_bytes) + "] for K, N");
  int64_t rows64 = 1;
  for (size_t i = 0; i + 1 < x_dims.size(); ++i) rows64 *= x_dims[i];
  if (rows64 > INT_MAX) return Fail("too many rows");
  const int rows = static_cast<int>(rows64);
  y_dims = x_dims;
  y_dims.back() = n;
  ort_abi::Value* y_value = nullptr;
  RETURN_IF_ERROR(g_api->GetOutput(context, 0, y_dims.data(), y_dims.size(), &y_value));
  if (rows == 0) return nullptr;
  const float* x = nullptr;
  const uint8_t* w = nullptr;
  float* y = nullptr;
  RETURN_IF_ERROR(g_api->GetTensorData(x_value, reinterpret_cast<void**>(const_cast<float**>(&x))));
  RETURN_IF_ERROR(g_api->GetTensorData(w_value, reinterpret_cast<void**>(const_cast<uint8_t**>(&w))));
  RETURN_IF_ERROR(g_api->GetTensorData(y_value, reinterpret_cast<void**>(&y)));
  const int per_task = rows >= 8 ? 1 : 4;
  const size_t tasks = static_cast<size_t>((tiles + per_task - 1) / per_task);
  if (kernel.accuracy_level == 0) {
    Job job{kernel.isa, kernel.bits, x, nullptr, nullptr, nullptr, nullptr, nullptr, rows, k, n, tiles, per_task, w, y};
    return g_api->ParallelFor(context, RunTask, tasks, 0, &job);
  }
  if (kernel.accuracy_level == 2) {
    thread_local std::vector<int16_t> xq16;       // NOTE: reused per thread, as below
    thread_local std::vector<float> dx16;
    xq16.resize(static_cast<size_t>(rows) * k);
    dx16.resize(static_cast<size_t>(rows) * nb);
    for (int m = 0; m < rows; ++m)
      kiln_q4::QuantizeRowI16(kernel.isa, x + static_cast<size_t>(m) * k, k, xq16.data() + static_cast<size_t>(m) * k,
                              dx16.data() + static_cast<size_t>(m) * nb);
    Job job{kernel.isa, kernel.bits, nullptr, nullptr, xq16.data(), dx16.data(), nullptr, nullptr, rows, k, n, tiles,
            per_task, w, y};
    return g_api->ParallelFor(context, RunTask, tasks, 0, &job);
  }
  // NOTE: per-thread scratch, reused across calls: no allocation on the decode path
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> scales;
  thread_local std::vector<int32_t> xqsum;
  xq.resize(static_cast<size_t>(rows) * k);
  scales.resize(static_cast<size_t>(rows) * nb * 2);
  float *dx = scales.data(), *xs = scales.data() + static_cast<size_t>(rows) * nb;
  for (int m = 0; m < rows; ++m)
    kiln_q4::QuantizeRow(kernel.isa, x + static_cast<size_t>(m) * k, k, xq.data() + static_cast<size_t>(m) * k, dx + m * nb, xs + m * nb);
  if (kernel.bits == 8) {       // int8 sums of each activation block (the AVX-512 path's code offset)
    xqsum.resize(static_cast<size_t>(rows) * nb);
    for (size_t i = 0; i < xqsum.size(); ++i) {
      int32_t sum = 0;
      for (int e = 0; e < kiln_q4::kBlock; ++e) sum += xq[i * kiln_q4::kBlock + e];
      xqsum[i] = sum;
    }
  }
  // a task is a few tiles (decode: enough tasks to share out, few enough to be cheap)
  Job job{kernel.isa, kernel.bits, nullptr, xq.data(), nullptr, dx, xs, xqsum.data(), rows, k, n, tiles, per_task, w, y};
  return g_api->ParallelFor(context, RunTask, tasks, 0, &job);
}

Status* CreateKernel(const ort_abi::CustomOp* op, const void*, const ort_abi::KernelInfo* info, void** out) {
  auto* kernel = new Kernel;
  kernel->bits = std::strcmp(kiln_ops::Name(op), "MatMulQ8") == 0 ? 8 : 4;
  Status* status = g_api->KernelInfoGetAttributeInt64(info, "K", &kernel->k);
  if (status == nullptr) status = g_api->KernelInfoGetAttributeInt64(info, "N", &kernel->n);
  if (status == nullptr)         // optional: 4 by default
    kernel->accuracy_level = kiln_ops::Optional<int64_t>(&ort_abi::Api::KernelInfoGetAttributeInt64, info,
                                                         "accuracy_level", 4);
  if (status == nullptr && kernel->accuracy_level != 0 && kernel->accuracy_level != 4 &&
      !(kernel->accuracy_level == 2 && kernel->bits == 8))
    status = Fail(kernel->bits == 8 ? "accuracy_level must be 0 (float activations), 2 (int16) or 4 (int8)"
                                    : "accuracy_level must be 0 (float activations) or 4 (int8 activations)");
  if (status == nullptr && (kernel->k <= 0 || kernel->k % kiln_q4::kBlock || kernel->n <= 0 || kernel->k > INT_MAX || kernel->n > INT_MAX))
    status = Fail("K must be a positive multiple of 32 and N positive");
  if (status != nullptr) {
    delete kernel;
    return status;
  }
  kernel->isa = kiln_q4::SelectIsa();
  *out = kernel;
  return nullptr;
}

void DestroyKernel(void* kernel) { delete static_cast<Kernel*>(kernel); }
ort_abi::ElementType InputType(const ort_abi::CustomOp*, size_t index) {
  return index == 0 ? ort_abi::kFloat : ort_abi::kUint8;
}
size_t InputCount(const ort_abi::CustomOp*) { return 2; }

kiln_ops::NamedOp MatMulOp(const char* name) {
  return kiln_ops::MakeOp(name, {InputType, InputCount, CreateKernel, Compute, DestroyKernel});
}

}  // namespace

extern "C" {

// ONNX Runtime calls this when a session's options register the library.
__attribute__((visibility("default"))) Status* RegisterCustomOps(ort_abi::SessionOptions* options,
                                                                const ort_abi::ApiBase* base) {
  const void* const* table = base->GetApi(ort_abi::kMinApiVersion);
  if (table == nullptr) {
    // a runtime older than API 17: report it through the oldest table there is
    return ort_abi::Api(base->GetApi(1)).CreateStatus(ort_abi::kFail, "kiln's op library needs onnxruntime >= 1.17");
  }
  static const ort_abi::Api api(table);
  kiln_ops::g_api = &api;
  static kiln_ops::NamedOp q4 = MatMulOp("MatMulQ4Min"), q8 = MatMulOp("MatMulQ8"),
                           attention = kiln_ops::PagedAttentionOp();
  ort_abi::OpDomain* domain = nullptr;        // NOTE: owned by the sessions for their lifetime; never released
  RETURN_IF_ERROR(api.CreateCustomOpDomain("kiln", &domain));
  RETURN_IF_ERROR(api.CustomOpDomainAdd(domain, &q4.op));
  RETURN_IF_ERROR(api.CustomOpDomainAdd(domain, &q8.op));
  RETURN_IF_ERROR(api.CustomOpDomainAdd(domain, &attention.op));
  return api.AddCustomOpDomain(options, domain);
}

// Which vector path this CPU gets (with KILN_Q4_ISA applied): "avx512vnni" | "avx2" | "scalar".
__attribute__((visibility("default"))) const char* KilnQ4Isa() { return kiln_q4::IsaName(kiln_q4::SelectIsa()); }

}  // extern "C"
