// The OpenVINO operations kiln.PagedAttentionU8 and kiln.PagedAttentionF16: attention over a KV cache
// in kiln's own layout (kiln/kernels/paged_kv_attention.h: u8 codes with a scale and a minimum per
// token and head, or f16), on the packed tokens and sequence inputs of OpenVINO's
// PagedAttentionExtension, so the engine feeds both the same way. The call stores its new keys and
// values into their blocks, then attends. Its cache inputs are u8, which the CPU plugin hands to the
// operation as the memory the engine bound: the stores persist between calls, as the plugin's own
// operation's do.
//
//     out [T, H*hd] = PagedAttentionU8(q [T, H*hd], k [T, KVH*hd], v [T, KVH*hd],
//                                      key_cache, value_cache [blocks, KVH, block_size, row bytes] u8,
//                                      past_lens [B], subsequence_begins [B+1], block_indices [*],
//                                      block_indices_begins [B+1] (i32), scale [] f32, window [] i32,
//                                      softcap [] f32)
#include "paged_attention_op.h"

#include <openvino/core/parallel.hpp>
#include <openvino/op/op.hpp>

#include <algorithm>
#include <atomic>
#include <vector>

#include "kernels.h"

namespace kiln {
namespace ov_ops {
namespace {

enum Input { kQ, kK, kV, kKeyCache, kValueCache, kPastLens, kBegins, kBlocks, kBlockBegins, kScale, kWindow, kSoftcap,
             kInputs };

const Kernels& AttentionKernels(const Kernels& k) {
  OPENVINO_ASSERT(k.attend_kv != nullptr && k.store_token != nullptr, "kiln's paged attention is missing from ",
                  "this kernel library: rebuild it (python -m kiln.engines.openvino.native.build)");
  return k;
}

// The sequences of the call, each checked against the pool before anything is read or written.
std::vector<PackedSequence> Sequences(const PackedAttention& s, const ov::TensorVector& in) {
  const size_t count = in[kPastLens].get_size();
  OPENVINO_ASSERT(in[kBegins].get_size() == count + 1 && in[kBlockBegins].get_size() == count + 1,
                  "kiln's paged attention: past_lens, subsequence_begins and block_indices_begins disagree on the "
                  "number of sequences");
  const auto* past = in[kPastLens].data<const int32_t>();
  const auto* begins = in[kBegins].data<const int32_t>();
  const auto* blocks = in[kBlockBegins].data<const int32_t>();
  const auto* ids = in[kBlocks].data<const int32_t>();
  const int64_t all_ids = static_cast<int64_t>(in[kBlocks].get_size());
  std::vector<PackedSequence> seqs(count);
  for (size_t b = 0; b < count; ++b) {
    OPENVINO_ASSERT(blocks[b] >= 0 && blocks[b] <= blocks[b + 1] && blocks[b + 1] <= all_ids,
                    "kiln's paged attention: block_indices_begins does not index block_indices");
    seqs[b] = {past[b], begins[b], begins[b + 1] - begins[b], ids + blocks[b], blocks[b + 1] - blocks[b]};
    const char* wrong = CheckPacked(s, seqs[b]);
    OPENVINO_ASSERT(wrong == nullptr, "kiln's paged attention: ", wrong == nullptr ? "" : wrong);
  }
  return seqs;
}

// The call's new keys and values into their blocks: token i of sequence b sits at position past + i.
void Store(const Kernels& run, KvFormat f, const PackedAttention& s, const std::vector<PackedSequence>& seqs, const float* k,
           const float* v, uint8_t* key_cache, uint8_t* value_cache) {
  std::vector<std::pair<int, int>> rows;          // (sequence, token) of every new token
  for (size_t b = 0; b < seqs.size(); ++b)
    for (int i = 0; i < seqs[b].count; ++i) rows.emplace_back(static_cast<int>(b), i);
  const size_t segment = SegmentBytes(s.head_dim, s.block_size, f);
  ov::parallel_for(rows.size() * s.kv_heads, [&](size_t task) {
    const auto [b, i] = rows[task / s.kv_heads];
    const int g = static_cast<int>(task % s.kv_heads);
    const PackedSequence& seq = seqs[b];
    const int64_t position = seq.past + i;
    const size_t at = (static_cast<size_t>(seq.blocks[position / s.block_size]) * s.kv_heads + g) * segment;
    const int slot = static_cast<int>(position % s.block_size);
    const size_t from = (static_cast<size_t>(seq.begin) + i) * s.kv_heads * s.head_dim + g * s.head_dim;
    run.store_token(f, k + from, s.head_dim, s.block_size, key_cache + at, slot, true);
    run.store_token(f, v + from, s.head_dim, s.block_size, value_cache + at, slot, false);
  });
}

struct Task {
  int sequence, kv_head, kv_heads, s0, s1;
  bool decode;        // a u8 decode on the level's decode_kv: kv heads [kv_head, kv_head + kv_heads)
};

// Decodes on decode_kv read a sequence's blocks once for all its kv heads (a block's keys of consecutive
// heads are one run of the cache), where there are sequences enough to keep every thread busy; else a
// task per kv head.
int DecodeHeadsPerTask(const PackedAttention& s, const std::vector<PackedSequence>& seqs) {
  const auto decodes = std::count_if(seqs.begin(), seqs.end(), [](const PackedSequence& q) { return q.count == 1; });
  return decodes >= 2 * static_cast<int64_t>(::parallel_get_max_threads()) ? s.kv_heads : 1;
}

// Runs of a sequence's new tokens, each at most the kernel's query vectors per task with the group's heads,
// for every kv head (or several kv heads, for a decode); the costliest first (queries times the keys
// they read), so that threads taking the next task as they finish end together (a causal prefill's
// last runs read the most keys).
std::vector<Task> Tasks(const Kernels& run, KvFormat f, const PackedAttention& s, const std::vector<PackedSequence>& seqs) {
  const int queries = run.kv_task_queries != nullptr ? run.kv_task_queries(s.head_dim) : kKvMaxQueries;
  const int per_task = std::max(1, queries / (s.heads / s.kv_heads));
  const bool on_decode_kv = run.decode_kv != nullptr && f == KvFormat::kU8;
  const int decode_heads = on_decode_kv ? DecodeHeadsPerTask(s, seqs) : 1;
  std::vector<Task> tasks;
  for (size_t b = 0; b < seqs.size(); ++b) {
    const int sequence = static_cast<int>(b);
    if (on_decode_kv && seqs[b].count == 1) {
      for (int g = 0; g < s.kv_heads; g += decode_heads)
        tasks.push_back({sequence, g, std::min(decode_heads, s.kv_heads - g), 0, 1, true});
      continue;
    }
    for (int s0 = 0; s0 < seqs[b].count; s0 += per_task)
      for (int g = 0; g < s.kv_heads; ++g)
        tasks.push_back({sequence, g, 1, s0, std::min(seqs[b].count, s0 + per_task), false});
  }
  const auto cost = [&](const Task& t) {
    return static_cast<int64_t>(t.s1 - t.s0) * (seqs[t.sequence].past + t.s1) * t.kv_heads;
  };
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) { return cost(a) > cost(b); });
  return tasks;
}

// Every task once, each thread taking the next one when it is free.
template <typename F>
void RunTasks(size_t count, const F& run) {
  std::atomic<size_t> next{0};
  ov::parallel_nt(0, [&](int, int) {
    for (size_t i = next.fetch_add(1, std::memory_order_relaxed); i < count; i = next.fetch_add(1, std::memory_order_relaxed))
      run(i);
  });
}

// A cache row's head of values, from its bytes; 0 where the row fits no head of 16..kMaxHeadDim values
// (a multiple of 16).
int HeadDim(int64_t row_bytes, KvFormat f) {
  const int64_t hd = f == KvFormat::kU8 ? row_bytes - kU8RowExtra : row_bytes / 2;
  const bool fits = hd >= 16 && hd <= kMaxHeadDim && hd % 16 == 0 && RowBytes(static_cast<int>(hd), f) == row_bytes;
  return fits ? static_cast<int>(hd) : 0;
}

}  // namespace

template <KvFormat kFormat>
PagedKvAttention<kFormat>::PagedKvAttention(const ov::OutputVector& args) : ov::op::Op(args) {
  constructor_validate_and_infer_types();
}

template <KvFormat kFormat>
void PagedKvAttention<kFormat>::validate_and_infer_types() {
  NODE_VALIDATION_CHECK(this, get_input_size() == kInputs, "expects ", static_cast<int>(kInputs),
                        " inputs (kiln's u8 paged attention of another layout); rebuild the artifact");
  NODE_VALIDATION_CHECK(this, get_input_element_type(kKeyCache) == ov::element::u8 &&
                                  get_input_element_type(kValueCache) == ov::element::u8,
                        "the KV caches must be u8 (kiln's layout)");
  const auto& cache = get_input_partial_shape(kKeyCache);
  NODE_VALIDATION_CHECK(this, cache.rank().is_static() && cache.rank().get_length() == 4 && cache[3].is_static() &&
                                  cache[2].is_static() && cache[2].get_length() % 16 == 0 && cache[2].get_length() <= 64 &&
                                  HeadDim(cache[3].get_length(), kFormat) > 0,
                        "the KV cache's blocks must hold 16, 32, 48 or 64 tokens, each a head of 16..", kMaxHeadDim,
                        " values (a multiple of 16) and 8 bytes of scale and minimum");
  set_output_type(0, ov::element::f32, get_input_partial_shape(kQ));
}

template <KvFormat kFormat>
std::shared_ptr<ov::Node> PagedKvAttention<kFormat>::clone_with_new_inputs(const ov::OutputVector& args) const {
  return std::make_shared<PagedKvAttention<kFormat>>(args);
}

template <KvFormat kFormat>
bool PagedKvAttention<kFormat>::evaluate(ov::TensorVector& out, const ov::TensorVector& in) const {
  const auto& cache = in[kKeyCache].get_shape();
  const int hd = HeadDim(static_cast<int64_t>(cache[3]), kFormat);
  OPENVINO_ASSERT(hd > 0, "kiln's paged attention: the KV cache's rows fit no head of values");
  const auto& qs = in[kQ].get_shape();
  OPENVINO_ASSERT(qs.size() == 2 && qs[1] % hd == 0 && in[kK].get_shape() == in[kV].get_shape() &&
                      in[kK].get_shape()[0] == qs[0] && in[kK].get_shape()[1] == cache[1] * hd &&
                      in[kValueCache].get_shape() == cache,
                  "kiln's paged attention: q, k, v and the caches do not agree on the heads");
  const PackedAttention s{static_cast<int>(qs[0]), static_cast<int>(qs[1]) / hd, static_cast<int>(cache[1]), hd,
                          static_cast<int>(cache[0]), static_cast<int>(cache[2]),
                          static_cast<int>(in[kPastLens].get_size())};
  OPENVINO_ASSERT(s.heads % s.kv_heads == 0, "kiln's paged attention: the query heads are not a multiple of the kv heads");
  const AttentionParams p{in[kScale].data<const float>()[0], in[kSoftcap].data<const float>()[0],
                          in[kWindow].data<const int32_t>()[0]};
  const Kernels& run = AttentionKernels(kernels_);
  const std::vector<PackedSequence> seqs = Sequences(s, in);
  // NOTE: the caches are the engine's bound memory; writing through them is how the cache persists.
  auto* key_cache = static_cast<uint8_t*>(const_cast<void*>(in[kKeyCache].data()));
  auto* value_cache = static_cast<uint8_t*>(const_cast<void*>(in[kValueCache].data()));
  Store(run, kFormat, s, seqs, in[kK].data<const float>(), in[kV].data<const float>(), key_cache, value_cache);
  out[0].set_shape(qs);
  float* result = out[0].data<float>();
  const float *q = in[kQ].data<const float>(), *k = in[kK].data<const float>(), *v = in[kV].data<const float>();
  const std::vector<Task> tasks = Tasks(run, kFormat, s, seqs);
  RunTasks(tasks.size(), [&](size_t i) {
    const Task& t = tasks[i];
    if (t.decode)
      return run.decode_kv(s, p, q, key_cache, value_cache, seqs[t.sequence], t.kv_head, t.kv_head + t.kv_heads, result);
    run.attend_kv(kFormat, s, p, q, k, v, key_cache, value_cache, seqs[t.sequence], t.kv_head, t.s0, t.s1, result);
  });
  return true;
}

template class PagedKvAttention<KvFormat::kU8>;
template class PagedKvAttention<KvFormat::kF16>;

}  // namespace ov_ops
}  // namespace kiln
