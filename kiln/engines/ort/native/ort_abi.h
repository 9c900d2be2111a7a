// The part of ONNX Runtime's C ABI that kiln's op library calls, declared here so the library builds
// with nothing but a C++ compiler: the onnxruntime wheel ships no headers, and no package this project
// installs does.
//
// Why numbers are enough: ONNX Runtime keeps its C ABI append-only. The function table a runtime hands
// out (GetApi) is an array of function pointers whose order never changes between releases, and the
// custom-op description (OrtCustomOp) only ever grows at its end, read up to the `version` it states.
// So a function is named by its place in the table, and the op struct lists its fields in order.
// The places below hold for every runtime that serves API version kMinApiVersion; tests load the
// library into a real onnxruntime session and compare the operators against numpy.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ort_abi {

constexpr uint32_t kMinApiVersion = 17;    // the newest function used (KernelContext_ParallelFor) came in 17
constexpr uint32_t kCustomOpVersion = 17;  // the OrtCustomOp fields up to GetEndVersion are read

// Opaque handles: only ever passed back to the runtime.
struct Status;
struct Value;
struct TensorInfo;
struct KernelInfo;
struct KernelContext;
struct OpDomain;
struct SessionOptions;

enum ErrorCode : int { kFail = 1, kInvalidArgument = 2 };
enum ElementType : int { kFloat = 1, kUint8 = 2, kInt64 = 7 };
enum MemType : int { kMemTypeDefault = 0 };
enum Characteristic : int { kRequired = 0 };

// The places of the functions used, in the runtime's function table.
enum Slot : int {
  kCreateStatus = 0,
  kCreateCustomOpDomain = 26,
  kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttributeFloat = 85,
  kKernelInfoGetAttributeInt64 = 86,
  kKernelContextGetInput = 90,
  kKernelContextGetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
  kKernelContextParallelFor = 274,
};

struct CustomOp;

// What the runtime passes to RegisterCustomOps: the way to its function table.
struct ApiBase {
  const void* const* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// The custom-op description, field by field in the runtime's order (unused fields stay null).
struct CustomOp {
  uint32_t version;
  void* (*CreateKernel)(const CustomOp*, const void* api, const KernelInfo*);
  const char* (*GetName)(const CustomOp*);
  const char* (*GetExecutionProviderType)(const CustomOp*);
  ElementType (*GetInputType)(const CustomOp*, size_t index);
  size_t (*GetInputTypeCount)(const CustomOp*);
  ElementType (*GetOutputType)(const CustomOp*, size_t index);
  size_t (*GetOutputTypeCount)(const CustomOp*);
  void (*KernelCompute)(void* kernel, KernelContext*);
  void (*KernelDestroy)(void* kernel);
  Characteristic (*GetInputCharacteristic)(const CustomOp*, size_t index);       // version 8
  Characteristic (*GetOutputCharacteristic)(const CustomOp*, size_t index);
  MemType (*GetInputMemoryType)(const CustomOp*, size_t index);                  // version 11
  int (*GetVariadicInputMinArity)(const CustomOp*);                              // version 14
  int (*GetVariadicInputHomogeneity)(const CustomOp*);
  int (*GetVariadicOutputMinArity)(const CustomOp*);
  int (*GetVariadicOutputHomogeneity)(const CustomOp*);
  Status* (*CreateKernelV2)(const CustomOp*, const void* api, const KernelInfo*, void** kernel);  // 16
  Status* (*KernelComputeV2)(void* kernel, KernelContext*);
  Status* (*InferOutputShapeFn)(const CustomOp*, void* shape_context);          // version 17
  int (*GetStartVersion)(const CustomOp*);
  int (*GetEndVersion)(const CustomOp*);
  size_t (*GetMayInplace)(int** inputs, int** outputs);                          // later versions: kept null
  void (*ReleaseMayInplace)(int* inputs, int* outputs);
  size_t (*GetAliasMap)(int** inputs, int** outputs);
  void (*ReleaseAliasMap)(int* inputs, int* outputs);
};

// The runtime's function table, with typed calls for the functions used.
class Api {
 public:
  explicit Api(const void* const* table) : table_(table) {}

  Status* CreateStatus(ErrorCode code, const char* message) const {
    return Fn<Status* (*)(ErrorCode, const char*)>(kCreateStatus)(code, message);
  }
  void ReleaseStatus(Status* status) const { Fn<void (*)(Status*)>(kReleaseStatus)(status); }
  Status* CreateCustomOpDomain(const char* name, OpDomain** out) const {
    return Fn<Status* (*)(const char*, OpDomain**)>(kCreateCustomOpDomain)(name, out);
  }
  Status* CustomOpDomainAdd(OpDomain* domain, const CustomOp* op) const {
    return Fn<Status* (*)(OpDomain*, const CustomOp*)>(kCustomOpDomainAdd)(domain, op);
  }
  Status* AddCustomOpDomain(SessionOptions* options, OpDomain* domain) const {
    return Fn<Status* (*)(SessionOptions*, OpDomain*)>(kAddCustomOpDomain)(options, domain);
  }
  Status* KernelInfoGetAttributeInt64(const KernelInfo* info, const char* name, int64_t* out) const {
    return Fn<Status* (*)(const KernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttributeInt64)(info, name, out);
  }
  Status* KernelInfoGetAttributeFloat(const KernelInfo* info, const char* name, float* out) const {
    return Fn<Status* (*)(const KernelInfo*, const char*, float*)>(kKernelInfoGetAttributeFloat)(info, name, out);
  }
  Status* GetInput(const KernelContext* context, size_t index, const Value** out) const {
    return Fn<Status* (*)(const KernelContext*, size_t, const Value**)>(kKernelContextGetInput)(context, index, out);
  }
  Status* GetOutput(KernelContext* context, size_t index, const int64_t* dims, size_t count, Value** out) const {
    using F = Status* (*)(KernelContext*, size_t, const int64_t*, size_t, Value**);
    return Fn<F>(kKernelContextGetOutput)(context, index, dims, count, out);
  }
  // Also used to read inputs: the runtime's const getter came later than API 17; kiln never writes them.
  Status* GetTensorData(const Value* value, void** out) const {
    return Fn<Status* (*)(const Value*, void**)>(kGetTensorMutableData)(value, out);
  }
  Status* GetTensorTypeAndShape(const Value* value, TensorInfo** out) const {
    return Fn<Status* (*)(const Value*, TensorInfo**)>(kGetTensorTypeAndShape)(value, out);
  }
  Status* GetDimensionsCount(const TensorInfo* info, size_t* out) const {
    return Fn<Status* (*)(const TensorInfo*, size_t*)>(kGetDimensionsCount)(info, out);
  }
  Status* GetDimensions(const TensorInfo* info, int64_t* dims, size_t count) const {
    return Fn<Status* (*)(const TensorInfo*, int64_t*, size_t)>(kGetDimensions)(info, dims, count);
  }
  void ReleaseTensorInfo(TensorInfo* info) const { Fn<void (*)(TensorInfo*)>(kReleaseTensorTypeAndShapeInfo)(info); }
  Status* ParallelFor(const KernelContext* context, void (*fn)(void*, size_t), size_t total, size_t batch,
                      void* data) const {
    using F = Status* (*)(const KernelContext*, void (*)(void*, size_t), size_t, size_t, void*);
    return Fn<F>(kKernelContextParallelFor)(context, fn, total, batch, data);
  }

 private:
  template <typename F>
  F Fn(Slot slot) const {
    return reinterpret_cast<F>(const_cast<void*>(table_[slot]));
  }
  const void* const* table_;
};

}  // namespace ort_abi
