// The OpenVINO operations kiln.LinearI8 and kiln.GateUpI8, registered as an extension library the CPU
// plugin runs through evaluate(); their arithmetic is the kernel library's (kiln/kernels/kernels.h:
// I8PerChannel, u8 activations on AVX-512 VNNI). This file holds the operations and OpenVINO's
// threading; it is built for plain x86-64, so loading the library is safe on any x86-64: only a model
// that uses the operations reaches the kernels, and a CPU below avx512vnni (or KILN_MAX_ISA) is told so.
//
//     y[M, N] = LinearI8(x [..., K], codes, scale, comp, sm)      y = (x * sm) W^T
//     y[M, N] = GateUpI8(x, (codes, scale, comp) x 2, sm)         y = silu(x Wg^T) * (x Wu^T)
//
// Each row of x, times its channels' smoothing factors sm (SmoothQuant's 1/s: an outlier channel's
// range moves into the weight, where it costs no row scale), is quantized to u8 with one scale.
#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/core/parallel.hpp>
#include <openvino/op/op.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "paged_attention_op.h"

namespace kiln {
namespace ov_ops {
namespace {

constexpr size_t kFewRows = 64;       // up to here every worker quantizes all rows itself (no second dispatch)
constexpr size_t kStepTiles = 3;      // 16-column tiles a worker's share is counted in (the micro-kernel's step)

// The table of a level, which must have the I8PerChannel kernels. Taken when a node is made, as ONNX
// Runtime's kernels take theirs when created: a node keeps the level it was made with.
const Kernels& I8Kernels(const Kernels& k) {
  OPENVINO_ASSERT(k.i8_linear != nullptr, "kiln's int8 linears need AVX-512 VNNI; this CPU (or KILN_MAX_ISA) gives ",
                  kiln_isa(), ": rebuild the artifact here, and the build keeps the plugin's linears");
  return k;
}

// Runs body(rows, first tile, end tile) on each worker over its share of the tiles, in steps of
// three. Many rows are quantized once; few are quantized by each worker for itself (a second
// parallel dispatch would cost more than quantizing 64 rows twice).
template <typename Body>
void ForTiles(const Kernels& run, const float* x, const float* sm, size_t m, size_t k, size_t n, Body body) {
  const size_t kp = static_cast<size_t>(I8PerChannel::PaddedK(static_cast<int>(k)));
  const size_t tiles = n / kTileColumns, steps = (tiles + kStepTiles - 1) / kStepTiles;
  const auto quantize = [&](size_t row, uint8_t* q, float* s) {
    s[row] = run.quantize_u8(x + row * k, sm, static_cast<int>(k), static_cast<int>(kp), q + row * kp);
  };
  thread_local std::vector<uint8_t> shared_q;
  thread_local std::vector<float> shared_s;
  const bool shared = m > kFewRows;
  if (shared) {
    shared_q.resize(m * kp);
    shared_s.resize(m);
    uint8_t* q = shared_q.data();
    float* s = shared_s.data();
    ov::parallel_for(m, [&](size_t row) { quantize(row, q, s); });
  }
  const uint8_t* q = shared_q.data();
  const float* s = shared_s.data();
  ov::parallel_nt(0, [&](int ithr, int nthr) {
    size_t start = 0, end = 0;
    ov::splitter(steps, nthr, ithr, start, end);
    if (start >= end) return;
    U8Rows rows{q, s, kp, static_cast<int>(k)};
    thread_local std::vector<uint8_t> own_q;
    thread_local std::vector<float> own_s;
    if (!shared) {
      own_q.resize(m * kp);
      own_s.resize(m);
      for (size_t row = 0; row < m; ++row) quantize(row, own_q.data(), own_s.data());
      rows = {own_q.data(), own_s.data(), kp, static_cast<int>(k)};
    }
    body(rows, static_cast<int>(start * kStepTiles), static_cast<int>(std::min(end * kStepTiles, tiles)));
  });
}

// y for one call: the linear's (one) or silu(gate) * up (two linears).
void Forward(const Kernels& run, const float* x, const float* sm, size_t m, size_t k, const I8Linear* linears,
             size_t count, size_t n, float* y) {
  ForTiles(run, x, sm, m, k, n, [&](const U8Rows& rows, int t0, int t1) {
    if (count == 1) run.i8_linear(rows, static_cast<int>(m), linears[0], t0, t1, y, n);
    else run.i8_gate_up(rows, static_cast<int>(m), linears[0], linears[1], t0, t1, y, n);
  });
}

}  // namespace

// Inputs: x [..., K] f32, then (codes, scale, comp) per linear, then sm [K] f32 (kiln/kernels/formats.h:
// I8PerChannel); output [..., N] f32, N = scale's length. kLinears 1: kiln.LinearI8; 2: kiln.GateUpI8.
template <size_t kLinears>
class PackedOp : public ov::op::Op {
 public:
  OPENVINO_OP(kLinears == 1 ? "LinearI8" : "GateUpI8", "kiln");
  PackedOp() = default;
  explicit PackedOp(const ov::OutputVector& args) : ov::op::Op(args) { constructor_validate_and_infer_types(); }
  void validate_and_infer_types() override {
    // NOTE: a graph packed another way (another kiln's layout, or a hostile artifact) is refused here,
    // when it is read, not run past the ends of its constants. What does not need x's K is checked
    // whatever x's shape: each linear's scale [N] (N a positive multiple of 16) and comp [N], the
    // same N for the gate and the up linear, codes a whole number of columns; K is x's last
    // dimension, or the smoothing factors' length while that one is dynamic. evaluate() checks the
    // tensors it gets again, so shapes left dynamic here are held to the same rule at run time.
    NODE_VALIDATION_CHECK(this, get_input_size() == 2 + 3 * kLinears, "expects x, (codes, scale, comp) x ", kLinears,
                          " and sm: kiln's int8 linears of another layout; rebuild the artifact");
    int64_t n = 0;
    for (size_t i = 0; i < kLinears; ++i) {
      const auto& scale = get_input_partial_shape(2 + 3 * i);
      const bool vector = scale.rank().is_static() && scale.rank().get_length() == 1 && scale[0].is_static();
      const int64_t ni = vector ? scale[0].get_length() : 0;
      NODE_VALIDATION_CHECK(this, ni > 0 && ni % kTileColumns == 0 && get_input_partial_shape(3 + 3 * i) == ov::PartialShape{ni},
                            "a linear's scale and comp are not [N] with N a multiple of ", kTileColumns,
                            " as kiln packs them; rebuild the artifact");
      NODE_VALIDATION_CHECK(this, i == 0 || ni == n, "the gate linear has ", n, " columns and the up linear ", ni,
                            ": kiln packs them alike; rebuild the artifact");
      n = ni;
      const auto& codes = get_input_partial_shape(1 + 3 * i);
      NODE_VALIDATION_CHECK(this, codes.rank().is_dynamic() || codes.rank().get_length() == 1,
                            "a linear's codes are not one flat vector as kiln packs them; rebuild the artifact");
    }
    const auto& x = get_input_partial_shape(0);
    const auto& sm = get_input_partial_shape(get_input_size() - 1);
    NODE_VALIDATION_CHECK(this, sm.rank().is_dynamic() || sm.rank().get_length() == 1,
                          "the smoothing factors are not a [K] vector; rebuild the artifact");
    NODE_VALIDATION_CHECK(this, x.rank().is_dynamic() || x.rank().get_length() >= 1, "x has no channels");
    ov::Dimension k = sm.rank().is_static() ? sm[0] : ov::Dimension::dynamic();
    if (x.rank().is_static()) {
      const auto& xk = x[x.rank().get_length() - 1];
      ov::Dimension merged;
      NODE_VALIDATION_CHECK(this, ov::Dimension::merge(merged, k, xk), "the smoothing factors do not have x's ", xk,
                            " channels; rebuild the artifact");
      k = merged;
    }
    if (k.is_static()) {
      NODE_VALIDATION_CHECK(this, k.get_length() > 0 && k.get_length() <= INT32_MAX / 2,
                            "x's channels (", k.get_length(), ") are out of range");
      const int64_t padded = I8PerChannel::PaddedK(static_cast<int>(k.get_length()));
      for (size_t i = 0; i < kLinears; ++i)
        NODE_VALIDATION_CHECK(this, get_input_partial_shape(1 + 3 * i).compatible(ov::PartialShape{n * padded}),
                              "a linear's codes do not fit x's ", k.get_length(),
                              " channels as kiln packs them; rebuild the artifact");
    }
    auto shape = x;
    if (shape.rank().is_static()) shape[shape.rank().get_length() - 1] = n;
    set_output_type(0, ov::element::f32, shape);
  }
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<PackedOp>(args);
  }
  bool visit_attributes(ov::AttributeVisitor&) override { return true; }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
    const auto& xs = in[0].get_shape();
    OPENVINO_ASSERT(!xs.empty() && in.size() == 2 + 3 * kLinears, "kiln's int8 linear: x has no channels");
    const size_t k = xs.back(), m = k ? ov::shape_size(xs) / k : 0, n = in[2].get_size();
    // the tensors themselves, whatever the graph left dynamic (validate_and_infer_types' rule)
    OPENVINO_ASSERT(k > 0 && k <= INT32_MAX / 2 && n > 0 && n % kTileColumns == 0 && in.back().get_size() == k,
                    "kiln's int8 linear: x's ", k, " channels, ", n, " columns or the smoothing factors do not fit "
                    "kiln's packing; rebuild the artifact");
    for (size_t i = 0; i < kLinears; ++i)
      OPENVINO_ASSERT(in[2 + 3 * i].get_size() == n && in[3 + 3 * i].get_size() == n &&
                          in[1 + 3 * i].get_byte_size() ==
                              n * static_cast<size_t>(I8PerChannel::PaddedK(static_cast<int>(k))),
                      "kiln's int8 linear: a linear's codes, scale or comp do not fit x's ", k,
                      " channels as kiln packs them; rebuild the artifact");
    auto ys = xs;
    ys.back() = n;
    out[0].set_shape(ys);
    I8Linear linears[kLinears];
    for (size_t i = 0; i < kLinears; ++i)
      linears[i] = {static_cast<const int8_t*>(in[1 + 3 * i].data()), in[2 + 3 * i].data<const float>(),
                    in[3 + 3 * i].data<const float>()};
    Forward(I8Kernels(kernels_), in[0].data<const float>(), in[1 + 3 * kLinears].data<const float>(), m, k, linears,
            kLinears, n, out[0].data<float>());
    return true;
  }

 private:
  const Kernels& kernels_ = KernelsFor(HostIsa());       // the level when the node is made
};

using LinearI8 = PackedOp<1>;
using GateUpI8 = PackedOp<2>;

}  // namespace ov_ops
}  // namespace kiln

// For tests: the kernel without OpenVINO's graph around it.
extern "C" __attribute__((visibility("default"))) void kiln_ov_linear_i8(const float* x, const float* sm, size_t m,
                                                                         size_t k, const int8_t* codes,
                                                                         const float* scale, const float* comp,
                                                                         size_t n, float* y) {
  const kiln::I8Linear linear{codes, scale, comp};
  static const kiln::Kernels& kernels = kiln::KernelsFor(kiln::HostIsa());       // the level when first called
  kiln::ov_ops::Forward(kiln::ov_ops::I8Kernels(kernels), x, sm, m, k, &linear, 1, n, y);
}

// For tests: silu(x Wg^T) * (x Wu^T) the same way.
extern "C" __attribute__((visibility("default"))) void kiln_ov_gate_up_i8(
    const float* x, const float* sm, size_t m, size_t k, const int8_t* gate_codes, const float* gate_scale,
    const float* gate_comp, const int8_t* up_codes, const float* up_scale, const float* up_comp, size_t n, float* y) {
  const kiln::I8Linear linears[] = {{gate_codes, gate_scale, gate_comp}, {up_codes, up_scale, up_comp}};
  static const kiln::Kernels& kernels = kiln::KernelsFor(kiln::HostIsa());
  kiln::ov_ops::Forward(kiln::ov_ops::I8Kernels(kernels), x, sm, m, k, linears, 2, n, y);
}

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({
    std::make_shared<ov::OpExtension<kiln::ov_ops::LinearI8>>(),
    std::make_shared<ov::OpExtension<kiln::ov_ops::GateUpI8>>(),
    std::make_shared<ov::OpExtension<kiln::ov_ops::PagedAttentionU8>>(),
    std::make_shared<ov::OpExtension<kiln::ov_ops::PagedAttentionF16>>(),
}));
