// What the library's operators share: the runtime's function table, errors, shapes, and the parts
// of an op description that are the same for all of them (CPU, required inputs, any opset).
#pragma once

#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "ort_abi.h"

namespace kiln {
namespace ort {

using ort_abi::Status;

inline const ort_abi::Api* g_api = nullptr;     // set once, when a session registers the library

inline Status* Fail(const std::string& message) {
  return g_api->CreateStatus(ort_abi::kInvalidArgument, ("kiln op library: " + message).c_str());
}

#define RETURN_IF_ERROR(expr)                 \
  do {                                        \
    ort_abi::Status* status_ = (expr);        \
    if (status_ != nullptr) return status_;   \
  } while (0)

inline Status* Shape(const ort_abi::Value* value, std::vector<int64_t>* dims) {
  ort_abi::TensorInfo* info = nullptr;
  RETURN_IF_ERROR(g_api->GetTensorTypeAndShape(value, &info));
  size_t count = 0;
  Status* status = g_api->GetDimensionsCount(info, &count);
  if (status == nullptr) {
    dims->resize(count);
    status = g_api->GetDimensions(info, dims->data(), count);
  }
  g_api->ReleaseTensorInfo(info);
  return status;
}

// An optional attribute: `fallback` when the node does not set it.
template <typename T, typename Getter>
T Optional(Getter get, const ort_abi::KernelInfo* info, const char* name, T fallback) {
  T value = fallback;
  Status* missing = (g_api->*get)(info, name, &value);
  if (missing != nullptr) {
    g_api->ReleaseStatus(missing);
    return fallback;
  }
  return value;
}

struct NamedOp {
  ort_abi::CustomOp op;          // NOTE: first member, so a CustomOp* is a NamedOp*
  const char* name;
};

inline const char* Name(const ort_abi::CustomOp* op) { return reinterpret_cast<const NamedOp*>(op)->name; }
inline const char* Provider(const ort_abi::CustomOp*) { return "CPUExecutionProvider"; }
inline ort_abi::ElementType FloatOutput(const ort_abi::CustomOp*, size_t) { return ort_abi::kFloat; }
inline size_t OneOutput(const ort_abi::CustomOp*) { return 1; }
inline ort_abi::Characteristic Required(const ort_abi::CustomOp*, size_t) { return ort_abi::kRequired; }
inline ort_abi::MemType MemoryType(const ort_abi::CustomOp*, size_t) { return ort_abi::kMemTypeDefault; }
inline int One(const ort_abi::CustomOp*) { return 1; }
inline int StartVersion(const ort_abi::CustomOp*) { return 1; }
inline int EndVersion(const ort_abi::CustomOp*) { return INT_MAX; }

// An op of one float output on the CPU, with its inputs, kernel and compute.
struct OpParts {
  ort_abi::ElementType (*input_type)(const ort_abi::CustomOp*, size_t index);
  size_t (*input_count)(const ort_abi::CustomOp*);
  Status* (*create)(const ort_abi::CustomOp*, const void* api, const ort_abi::KernelInfo*, void** kernel);
  Status* (*compute)(void* kernel, ort_abi::KernelContext*);
  void (*destroy)(void* kernel);
};

inline NamedOp MakeOp(const char* name, const OpParts& parts) {
  NamedOp named;
  std::memset(&named, 0, sizeof named);
  named.name = name;
  ort_abi::CustomOp& op = named.op;
  op.version = ort_abi::kCustomOpVersion;
  op.GetName = Name;
  op.GetExecutionProviderType = Provider;
  op.GetOutputType = FloatOutput;
  op.GetOutputTypeCount = OneOutput;
  op.GetInputCharacteristic = Required;
  op.GetOutputCharacteristic = Required;
  op.GetInputMemoryType = MemoryType;
  op.GetVariadicInputMinArity = One;
  op.GetVariadicInputHomogeneity = One;
  op.GetVariadicOutputMinArity = One;
  op.GetVariadicOutputHomogeneity = One;
  op.GetStartVersion = StartVersion;
  op.GetEndVersion = EndVersion;
  op.GetInputType = parts.input_type;
  op.GetInputTypeCount = parts.input_count;
  op.CreateKernelV2 = parts.create;
  op.KernelComputeV2 = parts.compute;
  op.KernelDestroy = parts.destroy;
  return named;
}

NamedOp PagedAttentionOp();      // paged_attention_op.cc

}  // namespace ort
}  // namespace kiln
