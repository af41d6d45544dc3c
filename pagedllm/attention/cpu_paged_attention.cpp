// Attention of single query rows over the paged KV cache, read in place through the block table (no copy of any
// context): the decode and verify rows of the CPU backend (attention/cpu_backend.py).
//
// Row r is a query of one position of sequence s = row_seqs[r] (r itself when row_seqs is absent); it sees the first
// visible[r] positions of that sequence, position p at slot (block_tables[s, p / block_size], p % block_size).
// The query heads that share KV head h (heads h * group ... h * group + group - 1, as enable_gqa) are one task, so
// each key and value is read once for its group:
//   scores[g, p] = scale * dot(q[g], k[p]),  out[g] = sum_p softmax(scores[g])[p] v[p],
// in float32 throughout, whatever the cache holds: the queries' dtype (float32, bfloat16, float16), or float8 e4m3
// with a power-of-two scale per (block, head, offset), which multiplies scores and probabilities exactly.
//
// Invariant: a task runs on one thread, through the same instructions in the same order for a given visible length
// and shape, so a row's bits depend on nothing else in the step (other rows, their lengths, the thread count).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "cpu_vector_math.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using namespace pagedllm_cpu;

// Two sums of eight lanes each, side by side, then the lanes, then the last n % 8 products: a fixed order for each n.
inline float dot(const float* a, const float* b, int64_t n) {
  Lanes even = {}, odd = {};
  int64_t i = 0;
  for (; i + 2 * LANES <= n; i += 2 * LANES) {
    even += load_lanes(a + i) * load_lanes(b + i);
    odd += load_lanes(a + i + LANES) * load_lanes(b + i + LANES);
  }
  if (i + LANES <= n) {
    even += load_lanes(a + i) * load_lanes(b + i);
    i += LANES;
  }
  float total = sum_lanes(even + odd);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// A cache row of `dim` values as float32: float32 rows are read where they are, others widened into `scratch`.
inline const float* widened(const float* row, float*, int64_t) { return row; }

inline const float* widened(const c10::BFloat16* row, float* scratch, int64_t dim) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) scratch[d] = float_from_bits(static_cast<uint32_t>(bits[d]) << 16);
  return scratch;
}

inline const float* widened(const c10::Half* row, float* scratch, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) scratch[d] = static_cast<float>(row[d]);
  return scratch;
}

const std::array<float, 256>& fp8_values() {  // every e4m3 byte's value
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int byte = 0; byte < 256; ++byte) values[byte] = c10::detail::fp8e4m3fn_to_fp32_value(byte);
    return values;
  }();
  return table;
}

inline const float* widened(const c10::Float8_e4m3fn* row, float* scratch, int64_t dim) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
  const float* table = fp8_values().data();
  for (int64_t d = 0; d < dim; ++d) scratch[d] = table[bytes[d]];
  return scratch;
}

struct Shape {
  int64_t heads, kv_heads, group, dim, block_size, table_width;
};

// visit(p, head, row, row_scale) for positions p = 0 .. visible - 1 in order, block by block through the table, and
// for each KV head of first_head .. last_head - 1 at that position: its cache row as float32 (widened into
// `scratch` unless the cache is float32) and its fp8 scale (1 without scales). The rows of the position
// PREFETCH_AHEAD later are prefetched as each is visited: a sequence's blocks lie anywhere in the cache, which the
// hardware prefetchers do not follow.
constexpr int64_t PREFETCH_AHEAD = 2;

// What a task costs beside its keys (its buffers, queries and outputs), counted as keys when tasks are dealt out.
constexpr int64_t TASK_SETUP_KEYS = 16;

template <typename Cache, typename Visit>
inline void for_each_row(const Cache* cache, const float* scales, const int32_t* table, int64_t visible,
                         int64_t first_head, int64_t last_head, const Shape& shape, float* scratch, Visit&& visit) {
  const int64_t block_size = shape.block_size, blocks = (visible + block_size - 1) / block_size;
  const int64_t slot_values = shape.kv_heads * shape.dim, slot_bytes = slot_values * sizeof(Cache);
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t block = table[j], count = std::min(block_size, visible - j * block_size);
    for (int64_t offset = 0; offset < count; ++offset) {
      const int64_t p = j * block_size + offset, ahead = p + PREFETCH_AHEAD;
      if (ahead < visible) {
        const int64_t slot = table[ahead / block_size] * block_size + ahead % block_size;
        const char* row = reinterpret_cast<const char*>(cache + slot * slot_values);
        for (int64_t at = 0; at < slot_bytes; at += 64) __builtin_prefetch(row + at);
      }
      const Cache* slot_rows = cache + (block * block_size + offset) * slot_values;
      for (int64_t head = first_head; head < last_head; ++head) {
        const float row_scale = scales ? scales[(block * shape.kv_heads + head) * block_size + offset] : 1.f;
        visit(p, head, widened(slot_rows + head * shape.dim, scratch, shape.dim), row_scale);
      }
    }
  }
}

// KV heads first_head .. last_head - 1 of one row (their group query heads each) over its `visible` keys. Each head
// is computed by the same instructions whichever range it is part of; a range of several heads reads a block's
// rows of those heads as one run of memory, which the hardware prefetchers follow.
template <typename Query, typename Cache>
void attend_heads(const Query* query, const Cache* k_cache, const Cache* v_cache, const float* k_scales,
                  const float* v_scales, const int32_t* table, int64_t visible, int64_t first_head, int64_t last_head,
                  float scale, const Shape& shape, Query* out) {
  const int64_t dim = shape.dim, group = shape.group;
  const int64_t rows = (last_head - first_head) * group;  // query heads of the range
  thread_local std::vector<float> buffer;
  buffer.resize(rows * (visible + 2 * dim + 1) + dim);
  float* q = buffer.data();              // [rows, dim]: the queries, times the scale
  float* acc = q + rows * dim;           // [rows, dim]: the probability-weighted sums of values
  float* scores = acc + rows * dim;      // [rows, visible]: scores, then probabilities
  float* totals = scores + rows * visible;  // [rows]: the probabilities' sums
  float* widened_row = totals + rows;       // one cache row widened to float32
  const Query* first_query = query + first_head * group * dim;
  for (int64_t i = 0; i < rows * dim; ++i) q[i] = static_cast<float>(first_query[i]) * scale;
  for_each_row(k_cache, k_scales, table, visible, first_head, last_head, shape, widened_row,
               [&](int64_t p, int64_t head, const float* key, float key_scale) {
                 for (int64_t r = (head - first_head) * group; r < (head - first_head + 1) * group; ++r) {
                   scores[r * visible + p] = dot(q + r * dim, key, dim) * key_scale;
                 }
               });
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * visible;
    float largest = -INFINITY;
#pragma omp simd reduction(max : largest)
    for (int64_t p = 0; p < visible; ++p) largest = std::max(largest, s[p]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < visible; ++p) {
      s[p] = exp_nonpositive(s[p] - largest);
      total += s[p];
    }
    totals[r] = total;
  }
  std::fill(acc, acc + rows * dim, 0.f);
  for_each_row(v_cache, v_scales, table, visible, first_head, last_head, shape, widened_row,
               [&](int64_t p, int64_t head, const float* value, float value_scale) {
                 for (int64_t r = (head - first_head) * group; r < (head - first_head + 1) * group; ++r) {
                   const float weight = scores[r * visible + p] * value_scale;
                   float* a = acc + r * dim;
#pragma omp simd
                   for (int64_t d = 0; d < dim; ++d) a[d] += weight * value[d];
                 }
               });
  Query* first_out = out + first_head * group * dim;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < dim; ++d) first_out[r * dim + d] = static_cast<Query>(acc[r * dim + d] / totals[r]);
  }
}

// A task is a row's KV heads, all of them where rows alone keep the threads busy, else one. Each thread takes one
// run of consecutive tasks of about equal cost (the keys they read): rows' lengths vary (a step's contexts run from
// tens to thousands of keys), and equal counts of tasks left one thread with most of the keys.
template <typename Query, typename Cache>
void attend_rows(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const int32_t* row_seqs, const at::Tensor& visible, double scale,
                 const float* k_scales, const float* v_scales, const Shape& shape, at::Tensor& out) {
  const Query* q = query.data_ptr<Query>();
  const Cache* k = reinterpret_cast<const Cache*>(k_cache.data_ptr());
  const Cache* v = reinterpret_cast<const Cache*>(v_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lengths = visible.data_ptr<int32_t>();
  Query* o = out.data_ptr<Query>();
  const int64_t rows = query.size(0), row_stride = shape.heads * shape.dim;
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_task = rows >= threads ? shape.kv_heads : 1;
  const int64_t tasks_per_row = shape.kv_heads / heads_per_task, tasks = rows * tasks_per_row;
  // cost_before[t]: the cost of tasks 0 .. t - 1, a task's cost its row's keys plus a fixed part for its set-up
  std::vector<int64_t> cost_before(tasks + 1, 0);
  for (int64_t task = 0; task < tasks; ++task) {
    cost_before[task + 1] = cost_before[task] + lengths[task / tasks_per_row] + TASK_SETUP_KEYS;
  }
  const int64_t parts = std::min(tasks, threads);
  auto first_task_of = [&](int64_t part) {  // the first task whose cost starts at or past the part's share
    return std::lower_bound(cost_before.begin(), cost_before.end() - 1, cost_before[tasks] * part / parts) -
           cost_before.begin();
  };
  at::parallel_for(0, parts, 1, [&](int64_t first_part, int64_t end_part) {
    for (int64_t task = first_task_of(first_part); task < first_task_of(end_part); ++task) {
      const int64_t r = task / tasks_per_row, first_head = task % tasks_per_row * heads_per_task;
      const int64_t last_head = first_head + heads_per_task, seq = row_seqs ? row_seqs[r] : r;
      if (lengths[r] == 0) {  // nothing visible: a zero output
        std::fill(o + r * row_stride + first_head * shape.group * shape.dim,
                  o + r * row_stride + last_head * shape.group * shape.dim, static_cast<Query>(0.f));
        continue;
      }
      attend_heads(q + r * row_stride, k, v, k_scales, v_scales, tables + seq * shape.table_width, lengths[r],
                   first_head, last_head, static_cast<float>(scale), shape, o + r * row_stride);
    }
  });
}

}  // namespace

namespace pagedllm_cpu {

at::Tensor paged_attention_rows(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const std::optional<at::Tensor>& row_seqs,
                                const at::Tensor& visible, double scale, const std::optional<at::Tensor>& k_scale,
                                const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query: contiguous [rows, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "caches: contiguous [num_blocks, block_size, kv_heads, head_dim], K and V alike");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables: contiguous int32 [num_seqs, width]");
  TORCH_CHECK(visible.scalar_type() == at::kInt && visible.numel() == query.size(0), "visible: int32 [rows]");
  const Shape shape{query.size(1), k_cache.size(2), query.size(1) / k_cache.size(2), query.size(2),
                    k_cache.size(1), block_tables.size(1)};
  TORCH_CHECK(shape.dim == k_cache.size(3) && shape.heads % shape.kv_heads == 0, "query heads: a multiple of KV heads");
  const int64_t rows = query.size(0);
  const int32_t* seqs = nullptr;
  if (row_seqs) {
    TORCH_CHECK(row_seqs->scalar_type() == at::kInt && row_seqs->numel() == rows, "row_seqs: int32 [rows]");
    seqs = row_seqs->data_ptr<int32_t>();
  } else {
    TORCH_CHECK(rows <= block_tables.size(0), "without row_seqs, row r reads table row r");
  }
  const int32_t* lengths = visible.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t seq = seqs ? seqs[r] : r;
    TORCH_CHECK(seq >= 0 && seq < block_tables.size(0), "row ", r, ": sequence ", seq, " has no table row");
    TORCH_CHECK(lengths[r] >= 0 && lengths[r] <= shape.table_width * shape.block_size, "row ", r,
                ": visible length ", lengths[r], " is past its block table");
  }
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 == k_scale.has_value() && fp8 == v_scale.has_value(), "scales come with an fp8 cache, only");
  const float* k_scales = fp8 ? k_scale->data_ptr<float>() : nullptr;
  const float* v_scales = fp8 ? v_scale->data_ptr<float>() : nullptr;
  at::Tensor out = at::empty_like(query);
  auto run = [&](auto query_type, auto cache_type) {
    using Query = decltype(query_type);
    using Cache = decltype(cache_type);
    attend_rows<Query, Cache>(query, k_cache, v_cache, block_tables, seqs, visible, scale, k_scales, v_scales, shape,
                              out);
  };
  const auto query_type = query.scalar_type(), cache_type = k_cache.scalar_type();
  TORCH_CHECK(cache_type == query_type || fp8, "the cache holds the queries' dtype or fp8, got ", cache_type,
              " for ", query_type, " queries");
  auto over_cache = [&](auto query_value) {
    if (fp8) {
      run(query_value, c10::Float8_e4m3fn{});
    } else {
      run(query_value, query_value);
    }
  };
  with_float_type(query_type, "paged_attention_rows", over_cache);
  return out;
}

}  // namespace pagedllm_cpu

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def(
      "paged_attention_rows(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor? row_seqs, "
      "Tensor visible, float scale, Tensor? k_scale, Tensor? v_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("paged_attention_rows", &pagedllm_cpu::paged_attention_rows); }
