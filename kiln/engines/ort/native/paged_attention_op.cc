// kiln.PagedAttention as an ONNX Runtime operator (the arithmetic: kiln/kernels/paged_attention.h).
//
//   out = PagedAttention(q, k, v, key_cache, value_cache, block_tables, past_lens)
//   attributes: num_heads, kv_num_heads, scale (float), softcap (float, 0: none), local_window_size (0: none)
//
// The pools are read where they are (the runtime binds them zero-copy); the new tokens' K/V come in
// as inputs, because the runtime scatters them into the pool only after the call.
#include "kernels.h"
#include "op_library.h"

namespace kiln {
namespace ort {
namespace {

struct AttentionKernel {
  int64_t heads = 0, kv_heads = 0, window = 0;
  AttentionParams params;
  AttendFn attend = nullptr;
};

struct AttentionJob {
  AttendFn attend;
  AttentionShape shape;
  AttentionParams params;
  const float *q, *k, *v, *key_pool, *value_pool;
  const int64_t *tables, *past_lens;
  int chunks;                  // query chunks per (row, head)
  float* out;
};

constexpr int kQueriesPerTask = 16;

void AttendOne(void* data, size_t index) {
  const AttentionJob& j = *static_cast<const AttentionJob*>(data);
  const int chunk = static_cast<int>(index % j.chunks);
  const int head = static_cast<int>(index / j.chunks % j.shape.heads);
  const int row = static_cast<int>(index / j.chunks / j.shape.heads);
  const int s0 = chunk * kQueriesPerTask, s1 = s0 + kQueriesPerTask < j.shape.seq ? s0 + kQueriesPerTask : j.shape.seq;
  j.attend(j.shape, j.params, j.q, j.k, j.v, j.key_pool, j.value_pool, j.tables, j.past_lens,
                        row, head, s0, s1, j.out);
}

template <typename T>
Status* Data(const ort_abi::Value* value, const T** out) {
  return g_api->GetTensorData(value, reinterpret_cast<void**>(const_cast<T**>(out)));
}

Status* Compute(void* op_kernel, ort_abi::KernelContext* context) {
  const AttentionKernel& kernel = *static_cast<const AttentionKernel*>(op_kernel);
  const ort_abi::Value* in[7] = {};
  thread_local std::vector<int64_t> dims[7];      // NOTE: reused: no allocation per layer and step
  for (size_t i = 0; i < 7; ++i) {
    RETURN_IF_ERROR(g_api->GetInput(context, i, &in[i]));
    RETURN_IF_ERROR(Shape(in[i], &dims[i]));
  }
  const auto& q = dims[0];
  const auto& pool = dims[3];
  if (q.size() != 3 || dims[1].size() != 3 || dims[2].size() != 3 || pool.size() != 4 || dims[4] != pool ||
      dims[5].size() != 2 || dims[6].size() != 1)
    return Fail("PagedAttention wants q, k, v [B, S, heads*hd], pools [kv_heads, blocks, block, hd], "
                "block_tables [B, max_blocks], past_lens [B]");
  // NOTE: the kernel counts in int: every dimension narrowed to one must fit (a graph's shapes are
  // the artifact's word, not a promise)
  for (const int64_t d : {q[0], q[1], q[2], pool[0], pool[1], pool[2], pool[3], dims[5][1]})
    if (d < 0 || d > INT32_MAX) return Fail("PagedAttention: a dimension of the inputs exceeds 2^31 - 1");
  AttentionShape s{static_cast<int>(q[0]), static_cast<int>(q[1]), static_cast<int>(kernel.heads),
                     static_cast<int>(kernel.kv_heads), static_cast<int>(pool[3]), static_cast<int>(pool[1]),
                     static_cast<int>(pool[2]), static_cast<int>(dims[5][1])};
  if (pool[0] != kernel.kv_heads || q[2] != kernel.heads * s.head_dim || dims[1] != dims[2] ||
      dims[1][0] != q[0] || dims[1][1] != q[1] || dims[1][2] != kernel.kv_heads * s.head_dim ||
      dims[5][0] != q[0] || dims[6][0] != q[0])
    return Fail("PagedAttention: the inputs' shapes disagree with each other or with num_heads/kv_num_heads");
  if (s.head_dim <= 0 || s.head_dim > kMaxHeadDim || s.block_size <= 0)
    return Fail("PagedAttention: head_dim must be 1.." + std::to_string(kMaxHeadDim));
  const float *qd, *kd, *vd, *kp, *vp;
  const int64_t *tables, *past;
  RETURN_IF_ERROR(Data(in[0], &qd));
  RETURN_IF_ERROR(Data(in[1], &kd));
  RETURN_IF_ERROR(Data(in[2], &vd));
  RETURN_IF_ERROR(Data(in[3], &kp));
  RETURN_IF_ERROR(Data(in[4], &vp));
  RETURN_IF_ERROR(Data(in[5], &tables));
  RETURN_IF_ERROR(Data(in[6], &past));
  const char* bad = CheckTables(s, tables, past);
  if (bad != nullptr) return Fail(std::string("PagedAttention: ") + bad);
  ort_abi::Value* out_value = nullptr;
  RETURN_IF_ERROR(g_api->GetOutput(context, 0, q.data(), q.size(), &out_value));
  if (s.batch == 0 || s.seq == 0) return nullptr;
  float* out = nullptr;
  RETURN_IF_ERROR(g_api->GetTensorData(out_value, reinterpret_cast<void**>(&out)));
  const int chunks = (s.seq + kQueriesPerTask - 1) / kQueriesPerTask;
  AttentionJob job{kernel.attend, s, kernel.params, qd, kd, vd, kp, vp, tables, past, chunks, out};
  return g_api->ParallelFor(context, AttendOne, static_cast<size_t>(s.batch) * s.heads * chunks, 0, &job);
}

Status* CreateKernel(const ort_abi::CustomOp*, const void*, const ort_abi::KernelInfo* info, void** out) {
  auto* kernel = new AttentionKernel;
  Status* status = g_api->KernelInfoGetAttributeInt64(info, "num_heads", &kernel->heads);
  if (status == nullptr) status = g_api->KernelInfoGetAttributeInt64(info, "kv_num_heads", &kernel->kv_heads);
  if (status == nullptr) status = g_api->KernelInfoGetAttributeFloat(info, "scale", &kernel->params.scale);
  if (status == nullptr) {
    kernel->params.softcap = Optional<float>(&ort_abi::Api::KernelInfoGetAttributeFloat, info, "softcap", 0.f);
    kernel->window = Optional<int64_t>(&ort_abi::Api::KernelInfoGetAttributeInt64, info, "local_window_size", 0);
    kernel->params.window = static_cast<int>(kernel->window);
    if (kernel->heads <= 0 || kernel->kv_heads <= 0 || kernel->heads > INT32_MAX || kernel->heads % kernel->kv_heads ||
        kernel->window < 0 || kernel->window > INT_MAX || kernel->params.softcap < 0.f)
      status = Fail("PagedAttention: num_heads must be a positive multiple of kv_num_heads (below 2^31); softcap "
                    "and local_window_size >= 0");
  }
  if (status != nullptr) {
    delete kernel;
    return status;
  }
  kernel->attend = KernelsFor(HostIsa()).attend;
  *out = kernel;
  return nullptr;
}

void DestroyKernel(void* kernel) { delete static_cast<AttentionKernel*>(kernel); }
ort_abi::ElementType InputType(const ort_abi::CustomOp*, size_t index) {
  return index < 5 ? ort_abi::kFloat : ort_abi::kInt64;
}
size_t InputCount(const ort_abi::CustomOp*) { return 7; }

}  // namespace

NamedOp PagedAttentionOp() { return MakeOp("PagedAttention", {InputType, InputCount, CreateKernel, Compute, DestroyKernel}); }

}  // namespace ort
}  // namespace kiln
