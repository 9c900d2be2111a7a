// kiln.PagedAttentionU8 and kiln.PagedAttentionF16 (paged_attention_op.cpp), declared for the
// library's one registration list (linear_i8_op.cpp).
#pragma once

#include <openvino/op/op.hpp>

#include "kernels.h"

namespace kiln {
namespace ov_ops {

// kFormat: the cache's element format (kiln/kernels/paged_kv_attention.h).
template <KvFormat kFormat>
class PagedKvAttention : public ov::op::Op {
 public:
  OPENVINO_OP(kFormat == KvFormat::kU8 ? "PagedAttentionU8" : "PagedAttentionF16", "kiln");
  PagedKvAttention() = default;
  explicit PagedKvAttention(const ov::OutputVector& args);
  void validate_and_infer_types() override;
  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override;
  bool visit_attributes(ov::AttributeVisitor&) override { return true; }
  bool has_evaluate() const override { return true; }
  bool evaluate(ov::TensorVector& out, const ov::TensorVector& in) const override;

 private:
  const Kernels& kernels_ = KernelsFor(HostIsa());       // the level when the node is made
};

using PagedAttentionU8 = PagedKvAttention<KvFormat::kU8>;
using PagedAttentionF16 = PagedKvAttention<KvFormat::kF16>;

}  // namespace ov_ops
}  // namespace kiln
