// kiln's ONNX Runtime custom-op library, over the C ABI only (ort_abi.h): the operators of the `kiln`
// domain. The two linears are here; PagedAttention is in paged_attention_op.cc; the arithmetic of
// both is the kernel library's (kiln/kernels/kernels.h).
//
//     Y[..., N] = MatMulQ4Min(X[..., K] float, B [ceil(N/16), K/32, 320] uint8)      attributes K, N
//     Y[..., N] = MatMulQ8   (X[..., K] float, B [ceil(N/16), K/32, 544] uint8)      (accuracy_level)
//
// accuracy_level: 4 int8 activations (the default), 2 int16 activations (MatMulQ8 only), 0 float.
//
// B is a tile layout of kiln/kernels/formats.h: Q4_1 (4-bit codes with a half-float scale and
// minimum per block of 32; the op keeps its first name, MatMulQ4Min, since artifacts name it) or Q8_0
// (8-bit codes with a half-float scale). The rows of X are quantized once per call; ONNX Runtime's
// intra-op pool then shares out the tiles (KernelContext_ParallelFor). Loaded with
// SessionOptions.register_custom_ops_library.
#include "kernels.h"
#include "op_library.h"

namespace kiln {
namespace ort {
namespace {

enum class Format { kQ4_1, kQ8_0 };

struct Kernel {
  Format format = Format::kQ4_1;
  int64_t k = 0, n = 0;
  int64_t accuracy_level = 4;    // 4: int8 activations; 2: int16 (MatMulQ8); 0: float activations
  const Kernels* kernels = nullptr;
};

// One call's activations, in the form its accuracy level takes, and where the tiles go.
struct Job {
  const Kernel& kernel;
  FloatRows x;
  Int8Rows xq;
  Int16Rows xq16;
  int rows, tiles, tiles_per_task;
  const uint8_t* w;
  float* y;
};

void RunTask(void* data, size_t index) {
  const Job& j = *static_cast<const Job*>(data);
  const Kernels& run = *j.kernel.kernels;
  const int n = static_cast<int>(j.kernel.n);
  const int t0 = static_cast<int>(index) * j.tiles_per_task;
  const int t1 = t0 + j.tiles_per_task < j.tiles ? t0 + j.tiles_per_task : j.tiles;
  const bool q8 = j.kernel.format == Format::kQ8_0;
  switch (j.kernel.accuracy_level) {
    case 0: return (q8 ? run.q8_0_f32 : run.q4_1_f32)(j.x, j.rows, j.w, n, t0, t1, j.y);
    case 2: return run.q8_0_i16(j.xq16, j.rows, j.w, n, t0, t1, j.y);
    default: return (q8 ? run.q8_0_i8 : run.q4_1_i8)(j.xq, j.rows, j.w, n, t0, t1, j.y);
  }
}

Status* Compute(void* op_kernel, ort_abi::KernelContext* context) {
  const Kernel& kernel = *static_cast<const Kernel*>(op_kernel);
  const Kernels& run = *kernel.kernels;
  const int k = static_cast<int>(kernel.k), n = static_cast<int>(kernel.n), nb = k / kBlock;
  const int tiles = (n + kTileColumns - 1) / kTileColumns;
  const int block_bytes = kernel.format == Format::kQ8_0 ? Q8_0::kBlockBytes : Q4_1::kBlockBytes;
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
  // a task is a few tiles (decode: enough tasks to share out, few enough to be cheap)
  const int per_task = rows >= 8 ? 1 : 4;
  const size_t tasks = static_cast<size_t>((tiles + per_task - 1) / per_task);
  Job job{kernel, {x, k}, {}, {}, rows, tiles, per_task, w, y};
  // NOTE: per-thread scratch, reused across calls: no allocation on the decode path
  thread_local std::vector<int16_t> xq16;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> scales;
  thread_local std::vector<int32_t> xqsum;
  const size_t row_blocks = static_cast<size_t>(rows) * nb;
  if (kernel.accuracy_level == 2) {
    xq16.resize(static_cast<size_t>(rows) * k);
    scales.resize(row_blocks);
    for (int m = 0; m < rows; ++m)
      run.quantize_i16(x + static_cast<size_t>(m) * k, k, xq16.data() + static_cast<size_t>(m) * k,
                       scales.data() + static_cast<size_t>(m) * nb);
    job.xq16 = {xq16.data(), scales.data(), k};
  } else if (kernel.accuracy_level == 4) {
    xq.resize(static_cast<size_t>(rows) * k);
    scales.resize(row_blocks * 2);
    float *dx = scales.data(), *xs = scales.data() + row_blocks;
    for (int m = 0; m < rows; ++m)
      run.quantize_i8(x + static_cast<size_t>(m) * k, k, xq.data() + static_cast<size_t>(m) * k, dx + m * nb, xs + m * nb);
    if (kernel.format == Format::kQ8_0) {       // the int8 sums of each activation block (kiln/kernels/u8s8.h)
      xqsum.resize(row_blocks);
      BlockSums(xq.data(), row_blocks, xqsum.data());
    }
    job.xq = {xq.data(), dx, xs, xqsum.data(), k};
  }
  return g_api->ParallelFor(context, RunTask, tasks, 0, &job);
}

Status* CreateKernel(const ort_abi::CustomOp* op, const void*, const ort_abi::KernelInfo* info, void** out) {
  auto* kernel = new Kernel;
  const bool q8 = std::strcmp(Name(op), "MatMulQ8") == 0;
  kernel->format = q8 ? Format::kQ8_0 : Format::kQ4_1;
  Status* status = g_api->KernelInfoGetAttributeInt64(info, "K", &kernel->k);
  if (status == nullptr) status = g_api->KernelInfoGetAttributeInt64(info, "N", &kernel->n);
  if (status == nullptr)         // optional: 4 by default
    kernel->accuracy_level = Optional<int64_t>(&ort_abi::Api::KernelInfoGetAttributeInt64, info, "accuracy_level", 4);
  if (status == nullptr && kernel->accuracy_level != 0 && kernel->accuracy_level != 4 &&
      !(kernel->accuracy_level == 2 && q8))
    status = Fail(q8 ? "accuracy_level must be 0 (float activations), 2 (int16) or 4 (int8)"
                     : "accuracy_level must be 0 (float activations) or 4 (int8 activations)");
  if (status == nullptr && (kernel->k <= 0 || kernel->k % kBlock || kernel->n <= 0 || kernel->k > INT_MAX || kernel->n > INT_MAX))
    status = Fail("K must be a positive multiple of 32 and N positive");
  if (status != nullptr) {
    delete kernel;
    return status;
  }
  kernel->kernels = &KernelsFor(HostIsa());
  *out = kernel;
  return nullptr;
}

void DestroyKernel(void* kernel) { delete static_cast<Kernel*>(kernel); }
ort_abi::ElementType InputType(const ort_abi::CustomOp*, size_t index) {
  return index == 0 ? ort_abi::kFloat : ort_abi::kUint8;
}
size_t InputCount(const ort_abi::CustomOp*) { return 2; }

NamedOp MatMulOp(const char* name) {
  return MakeOp(name, {InputType, InputCount, CreateKernel, Compute, DestroyKernel});
}

}  // namespace
}  // namespace ort
}  // namespace kiln

extern "C" {

// ONNX Runtime calls this when a session's options register the library.
__attribute__((visibility("default"))) ort_abi::Status* RegisterCustomOps(ort_abi::SessionOptions* options,
                                                                         const ort_abi::ApiBase* base) {
  const void* const* table = base->GetApi(ort_abi::kMinApiVersion);
  if (table == nullptr) {
    // a runtime older than API 17: report it through the oldest table there is
    return ort_abi::Api(base->GetApi(1)).CreateStatus(ort_abi::kFail, "kiln's op library needs onnxruntime >= 1.17");
  }
  static const ort_abi::Api api(table);
  kiln::ort::g_api = &api;
  static kiln::ort::NamedOp q4 = kiln::ort::MatMulOp("MatMulQ4Min"), q8 = kiln::ort::MatMulOp("MatMulQ8"),
                            attention = kiln::ort::PagedAttentionOp();
  ort_abi::OpDomain* domain = nullptr;        // NOTE: owned by the sessions for their lifetime; never released
  RETURN_IF_ERROR(api.CreateCustomOpDomain("kiln", &domain));
  RETURN_IF_ERROR(api.CustomOpDomainAdd(domain, &q4.op));
  RETURN_IF_ERROR(api.CustomOpDomainAdd(domain, &q8.op));
  RETURN_IF_ERROR(api.CustomOpDomainAdd(domain, &attention.op));
  return api.AddCustomOpDomain(options, domain);
}

}  // extern "C"
