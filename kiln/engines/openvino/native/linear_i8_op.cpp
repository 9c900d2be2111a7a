// The OpenVINO operations kiln.LinearI8 and kiln.GateUpI8 (linear_i8_kernel.h), registered as an
// extension library the CPU plugin runs through evaluate(). Built without AVX-512 flags: loading it
// is safe on any x86-64; only a model that uses the operations reaches the kernel.
#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/op/op.hpp>

#include "linear_i8_kernel.h"

namespace kiln_ov {

// Inputs: x [..., K] f32, then (codes, scale, comp) per linear, then sm [K] f32 (linear_i8_kernel.h);
// output [..., N] f32, N = scale's length.
template <typename Derived>
class PackedOp : public ov::op::Op {
public:
    PackedOp() = default;
    explicit PackedOp(const ov::OutputVector& args) : ov::op::Op(args) {}
    void validate_and_infer_types() override {
        // NOTE: a graph packed another way (another kiln's layout) is refused here, when it is read,
        // not run past the ends of its constants.
        const size_t linears = Derived::LINEARS;
        NODE_VALIDATION_CHECK(this, get_input_size() == 2 + 3 * linears, "expects x, (codes, scale, comp) x ",
                              linears, " and sm: kiln's int8 linears of another layout; rebuild the artifact");
        const auto& x = get_input_partial_shape(0);
        if (x.rank().is_static() && x[x.rank().get_length() - 1].is_static()) {
            const auto K = x[x.rank().get_length() - 1].get_length();
            for (size_t i = 0; i < linears; ++i) {
                const auto& scale = get_input_partial_shape(2 + 3 * i);
                const auto N = scale.rank().is_static() && scale.rank().get_length() == 1 && scale[0].is_static()
                                   ? scale[0].get_length() : 0;
                NODE_VALIDATION_CHECK(this, N > 0 && N % 16 == 0 &&
                                      get_input_partial_shape(1 + 3 * i) == ov::PartialShape{N * ((K + 3) / 4) * 4} &&
                                      get_input_partial_shape(3 + 3 * i) == ov::PartialShape{N},
                                      "a linear's codes, scale and comp do not fit x's ", K,
                                      " channels as kiln packs them; rebuild the artifact");
            }
            NODE_VALIDATION_CHECK(this, get_input_partial_shape(get_input_size() - 1) == ov::PartialShape{K},
                                  "the smoothing factors do not have x's ", K, " channels; rebuild the artifact");
        }
        auto shape = get_input_partial_shape(0);
        if (shape.rank().is_static()) shape[shape.rank().get_length() - 1] = get_input_partial_shape(2)[0];
        set_output_type(0, ov::element::f32, shape);
    }
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<Derived>(args);
    }
    bool visit_attributes(ov::AttributeVisitor&) override { return true; }
    bool has_evaluate() const override { return true; }

protected:
    static PackedLinear linear(const ov::TensorVector& in, size_t first) {
        return {static_cast<const int8_t*>(in[first].data()), in[first + 1].data<const float>(),
                in[first + 2].data<const float>()};
    }
    // (M, K, N) of this call; the output shaped [..., N]
    static void shape_output(ov::TensorVector& out, const ov::TensorVector& in, size_t& M, size_t& K, size_t& N) {
        const auto& xs = in[0].get_shape();
        K = xs.back();
        M = K ? ov::shape_size(xs) / K : 0;
        N = in[2].get_shape()[0];
        auto ys = xs;
        ys.back() = N;
        out[0].set_shape(ys);
    }
};

class LinearI8 : public PackedOp<LinearI8> {
public:
    OPENVINO_OP("LinearI8", "kiln");
    static constexpr size_t LINEARS = 1;
    LinearI8() = default;
    explicit LinearI8(const ov::OutputVector& args) : PackedOp(args) { constructor_validate_and_infer_types(); }
    bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
        size_t M, K, N;
        shape_output(out, in, M, K, N);
        linear_i8(in[0].data<const float>(), in[4].data<const float>(), M, K, linear(in, 1), N, out[0].data<float>());
        return true;
    }
};

class GateUpI8 : public PackedOp<GateUpI8> {
public:
    OPENVINO_OP("GateUpI8", "kiln");
    static constexpr size_t LINEARS = 2;
    GateUpI8() = default;
    explicit GateUpI8(const ov::OutputVector& args) : PackedOp(args) { constructor_validate_and_infer_types(); }
    bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override {
        size_t M, K, N;
        shape_output(out, in, M, K, N);
        gate_up_i8(in[0].data<const float>(), in[7].data<const float>(), M, K, linear(in, 1), linear(in, 4), N, out[0].data<float>());
        return true;
    }
};

}  // namespace kiln_ov

// For tests: the kernel without OpenVINO's graph around it.
extern "C" __attribute__((visibility("default"))) void kiln_ov_linear_i8(
        const float* x, const float* sm, size_t M, size_t K, const int8_t* codes, const float* scale, const float* comp, size_t N, float* y) {
    kiln_ov::linear_i8(x, sm, M, K, {codes, scale, comp}, N, y);
}

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({
    std::make_shared<ov::OpExtension<kiln_ov::LinearI8>>(),
    std::make_shared<ov::OpExtension<kiln_ov::GateUpI8>>(),
}));
