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
#include <type_traits>
#include <vector>

namespace {

using namespace pagedllm_cpu;

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

// What a task costs beside its keys (its buffers, queries and outputs), counted as keys when tasks are dealt out.
constexpr int64_t TASK_SETUP_KEYS = 16;

// Keys a score tile takes at once, and how far ahead of a tile its rows are prefetched (a sequence's blocks lie
// anywhere in the cache, which the hardware prefetchers do not follow).
constexpr int64_t TILE_KEYS = 4;
constexpr int64_t PREFETCH_KEYS = 16;

// How the kernel reads a cache of type Cache: float32 and bfloat16 rows where they are (8 lanes widened as they
// are loaded), float16 and fp8 rows widened to float32 once per task.
template <typename Cache>
using RowOf = std::conditional_t<std::is_same_v<Cache, float> || std::is_same_v<Cache, c10::BFloat16>, Cache, float>;

using pagedllm_cpu::load_lanes;  // float32's, beside this overload

inline Lanes load_lanes(const c10::BFloat16* at) {
  typedef uint16_t Halves __attribute__((vector_size(16)));
  typedef uint32_t Words __attribute__((vector_size(32)));
  Halves bits;
  std::memcpy(&bits, at, sizeof bits);
  const Words words = __builtin_convertvector(bits, Words) << 16;
  Lanes lanes;
  std::memcpy(&lanes, &words, sizeof lanes);
  return lanes;
}

// Prefetches `count` values from `row` on, a cache line at a time.
template <typename Row>
inline void prefetch_span(const Row* row, int64_t count) {
  for (int64_t d = 0; d < count; d += 64 / sizeof(Row)) __builtin_prefetch(row + d);
}

// One KV head's cache rows for positions 0 .. visible - 1: `rows[p]` points into the cache, or into `widened_rows`
// (float16 and fp8 rows, each converted once); `row_scales[p]` is its fp8 scale (empty without scales).
template <typename Row>
struct HeadRows {
  std::vector<const Row*> rows;
  std::vector<float> widened_rows, row_scales;

  // Rows converted here are read here: each position prefetches the same offset of the next block, `span` values
  // (this head's row and the task's later heads').
  template <typename Cache>
  void gather(const Cache* cache, const float* scales, const int32_t* table, int64_t visible, int64_t head,
              int64_t span, const Shape& shape) {
    const int64_t block_size = shape.block_size, dim = shape.dim, slot_values = shape.kv_heads * dim;
    rows.resize(visible);
    row_scales.resize(scales ? visible : 0);
    if constexpr (!std::is_same_v<Cache, Row>) widened_rows.resize(visible * dim);
    for (int64_t p = 0, j = 0; p < visible; ++j) {  // block by block: no division a position
      const int64_t block = table[j], count = std::min(block_size, visible - p);
      const Cache* block_rows = cache + block * block_size * slot_values + head * dim;
      for (int64_t offset = 0; offset < count; ++offset, ++p) {
        if constexpr (std::is_same_v<Cache, Row>) {
          rows[p] = block_rows + offset * slot_values;
        } else {
          if (p + block_size < visible)
            prefetch_span(cache + (table[j + 1] * block_size + offset) * slot_values + head * dim, span);
          rows[p] = widened(block_rows + offset * slot_values, widened_rows.data() + p * dim, dim);
        }
        if (scales) row_scales[p] = scales[(block * shape.kv_heads + head) * block_size + offset];
      }
    }
  }
};

// scores[g, p] = dot(q[g], k[p]) * key_scale[p] for GT query heads (q rows `dim` apart, scores rows `visible`
// apart) and every key, TILE_KEYS keys at a time. Each score is one chain of fused multiply-adds over the head's
// vectors of 8 dims, its lanes summed by sum_lanes4, then the last dim % 8 products added in order: the same
// instructions for every key and query, wherever they fall in a tile.
template <int GT, typename Row>
void score_rows(const float* q, const HeadRows<Row>& keys, int64_t visible, int64_t dim, int64_t span, float* scores) {
  const int64_t vectors_end = dim / LANES * LANES;
  const Row* const* rows = keys.rows.data();
  const float* row_scales = keys.row_scales.empty() ? nullptr : keys.row_scales.data();
  for (int64_t p0 = 0; p0 < visible; p0 += TILE_KEYS) {
    const int64_t count = std::min(TILE_KEYS, visible - p0);
    const Row* k[TILE_KEYS];
#pragma GCC unroll 4
    for (int64_t i = 0; i < TILE_KEYS; ++i) k[i] = rows[p0 + std::min(i, count - 1)];  // repeats: discarded
    for (int64_t i = p0 + PREFETCH_KEYS; i < std::min(visible, p0 + PREFETCH_KEYS + TILE_KEYS); ++i)
      prefetch_span(rows[i], span);
    Lanes sum[GT][TILE_KEYS];
#pragma GCC unroll 4
    for (int g = 0; g < GT; ++g)
#pragma GCC unroll 4
      for (int64_t i = 0; i < TILE_KEYS; ++i) sum[g][i] = Lanes{};
    for (int64_t d = 0; d < vectors_end; d += LANES) {
      Lanes key[TILE_KEYS];
#pragma GCC unroll 4
      for (int64_t i = 0; i < TILE_KEYS; ++i) key[i] = load_lanes(k[i] + d);
#pragma GCC unroll 4
      for (int g = 0; g < GT; ++g) {
        const Lanes query = load_lanes(q + g * dim + d);
#pragma GCC unroll 4
        for (int64_t i = 0; i < TILE_KEYS; ++i) sum[g][i] = fma_lanes(query, key[i], sum[g][i]);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < GT; ++g) {
      Quad tile = sum_lanes4(sum[g][0], sum[g][1], sum[g][2], sum[g][3]);
      float* out = scores + g * visible + p0;
      if (count == TILE_KEYS && vectors_end == dim && !row_scales) {
        std::memcpy(out, &tile, sizeof tile);
        continue;
      }
      for (int64_t i = 0; i < count; ++i) {
        float total = tile[i];
        for (int64_t d = vectors_end; d < dim; ++d) total += q[g * dim + d] * static_cast<float>(k[i][d]);
        out[i] = row_scales ? total * row_scales[p0 + i] : total;
      }
    }
  }
}

// acc[g, d0 .. d0 + 8 DV) = sum over p in order of weights[g, p] v[p][d0 ..] for GT query heads (weights rows
// `visible` apart, acc rows `dim` apart): one chain of fused multiply-adds per output.
template <int GT, int DV, typename Row>
void value_tile(const float* weights, const HeadRows<Row>& values, int64_t visible, int64_t d0, int64_t dim, int64_t span,
                float* acc) {
  Lanes sum[GT][DV];
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < DV; ++j) sum[g][j] = Lanes{};
  for (int64_t p = 0; p < visible; ++p) {
    const Row* v = values.rows[p] + d0;
    if (p + PREFETCH_KEYS < visible) prefetch_span(values.rows[p + PREFETCH_KEYS] + d0, span);
    Lanes value[DV];
#pragma GCC unroll 4
    for (int j = 0; j < DV; ++j) value[j] = load_lanes(v + j * LANES);
#pragma GCC unroll 4
    for (int g = 0; g < GT; ++g) {
      const Lanes weight = broadcast_lanes(weights[g * visible + p]);
#pragma GCC unroll 4
      for (int j = 0; j < DV; ++j) sum[g][j] = fma_lanes(weight, value[j], sum[g][j]);
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < DV; ++j) std::memcpy(acc + g * dim + d0 + j * LANES, &sum[g][j], sizeof(Lanes));
}

// Every dim of acc for GT query heads: tiles of DV vectors (GT x DV sums, DV values and a weight in the 16 vector
// registers: 3 x 3 or 2 x 4), then the last dim % 8 dims, each output's sum in order.
template <int GT, typename Row>
void value_tiles(const float* weights, const HeadRows<Row>& values, int64_t visible, int64_t dim, int64_t span,
                 float* acc) {
  constexpr int DV = GT == 3 ? 3 : 4;
  const int64_t vectors = dim / LANES;
  int64_t j = 0;
  // the first tile prefetches `span` values of each row (the task's later heads' too), later tiles one line
  for (; j + DV <= vectors; j += DV)
    value_tile<GT, DV>(weights, values, visible, j * LANES, dim, j == 0 ? span : 1, acc);
  switch (vectors - j) {
    case 3: value_tile<GT, 3>(weights, values, visible, j * LANES, dim, j == 0 ? span : 1, acc); break;
    case 2: value_tile<GT, 2>(weights, values, visible, j * LANES, dim, j == 0 ? span : 1, acc); break;
    case 1: value_tile<GT, 1>(weights, values, visible, j * LANES, dim, j == 0 ? span : 1, acc); break;
    default: break;
  }
  for (int64_t d = vectors * LANES; d < dim; ++d)
    for (int g = 0; g < GT; ++g) {
      float total = 0.f;
      for (int64_t p = 0; p < visible; ++p) total += weights[g * visible + p] * static_cast<float>(values.rows[p][d]);
      acc[g * dim + d] = total;
    }
}

// The query heads of a group in tiles of up to three (three heads x four keys, or x four value vectors, are twelve
// sums in registers), as even as they go: group 4 -> 2 + 2, 8 -> 3 + 3 + 2. body(first, count).
template <typename Body>
inline void for_each_head_tile(int64_t group, Body&& body) {
  const int64_t tiles = (group + 2) / 3;
  for (int64_t t = 0, first = 0; t < tiles; ++t) {
    const int64_t count = group / tiles + (t < group % tiles);
    body(first, count);
    first += count;
  }
}

// KV heads first_head .. last_head - 1 of one row (their group query heads each) over its `visible` keys, read in
// place through the block table: scores, softmax, then the probability-weighted sum of values, in float32. Each
// head is computed by the same instructions whichever range it is part of and whatever else the step holds.
template <typename Query, typename Cache>
void attend_heads(const Query* query, const Cache* k_cache, const Cache* v_cache, const float* k_scales,
                  const float* v_scales, const int32_t* table, int64_t visible, int64_t first_head, int64_t last_head,
                  float scale, const Shape& shape, Query* out) {
  const int64_t dim = shape.dim, group = shape.group;
  thread_local std::vector<float> buffer;
  thread_local HeadRows<RowOf<Cache>> keys, values;
  buffer.resize(group * (visible + 2 * dim + 1));
  float* q = buffer.data();                 // [group, dim]: a KV head's queries, times the scale
  float* acc = q + group * dim;             // [group, dim]: the probability-weighted sums of values
  float* scores = acc + group * dim;        // [group, visible]: scores, then probabilities (times value scales)
  float* totals = scores + group * visible; // [group]: the probabilities' sums
  for (int64_t head = first_head; head < last_head; ++head) {
    const Query* head_query = query + head * group * dim;
    for (int64_t i = 0; i < group * dim; ++i) q[i] = static_cast<float>(head_query[i]) * scale;
    // Each pass prefetches the rows of this head and of the task's later heads, which lie after it in each slot:
    // the first head's passes read the range's part of every slot as one run of memory.
    // (rows widened by gather are prefetched there, as they are read)
    const int64_t span = (last_head - head) * dim, row_span = std::is_same_v<Cache, RowOf<Cache>> ? span : dim;
    keys.gather(k_cache, k_scales, table, visible, head, span, shape);
    for_each_head_tile(group, [&](int64_t g0, int64_t count) {
      if (count == 3) score_rows<3>(q + g0 * dim, keys, visible, dim, row_span, scores + g0 * visible);
      if (count == 2) score_rows<2>(q + g0 * dim, keys, visible, dim, row_span, scores + g0 * visible);
      if (count == 1) score_rows<1>(q + g0 * dim, keys, visible, dim, row_span, scores + g0 * visible);
    });
    values.gather(v_cache, v_scales, table, visible, head, span, shape);
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * visible;
      float largest = -INFINITY;
#pragma omp simd reduction(max : largest)
      for (int64_t p = 0; p < visible; ++p) largest = std::max(largest, s[p]);
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t p = 0; p < visible; ++p) {
        s[p] = exp_nonpositive(s[p] - largest);
        total += s[p];
      }
      totals[g] = total;
      if (v_scales)
        for (int64_t p = 0; p < visible; ++p) s[p] *= values.row_scales[p];
    }
    for_each_head_tile(group, [&](int64_t g0, int64_t count) {
      if (count == 3) value_tiles<3>(scores + g0 * visible, values, visible, dim, row_span, acc + g0 * dim);
      if (count == 2) value_tiles<2>(scores + g0 * visible, values, visible, dim, row_span, acc + g0 * dim);
      if (count == 1) value_tiles<1>(scores + g0 * visible, values, visible, dim, row_span, acc + g0 * dim);
    });
    Query* head_out = out + head * group * dim;
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < dim; ++d) head_out[g * dim + d] = static_cast<Query>(acc[g * dim + d] / totals[g]);
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
