// Attention over the paged KV cache on the CPU, reading the cache blocks in place.
//
// A step's queries are packed by sequence (query_starts); sequence b has seq_lens[b] tokens in the
// cache after this step's write, its queries are its last tokens, and query i of n sits at position
// seq_lens[b] - n + i and sees the keys at positions 0 .. that position (causal). Key position p of
// sequence b lives in slot block_tables[b][p / block_size] * block_size + p % block_size.
//
// Work items are (sequence, kv head, tile of up to TILE query rows, range of keys): each computes,
// for the tile's rows times the kv head's query heads, the softmax-weighted sum of its keys' values
// with an online softmax (running max, running sum), in float32. Where one sequence's rows and kv
// heads alone leave threads idle (decode), its keys are split into ranges whose partial results
// (max, sum, weighted values) are merged afterwards: flash-decoding on the CPU.

#include "common.h"
#include "simd.h"

namespace ferrum_cpu {
namespace {

constexpr int64_t TILE = 16;       // query rows of one work item
constexpr int64_t SUB = 64;        // keys scored at a time (a multiple of 16)
constexpr int64_t MIN_SPLIT = 256; // fewest keys a split range holds

struct Item {
  int64_t seq, kv_head, row0, rows, key0, key1, partial;  // partial: index into the split buffer, or -1
};

struct Partial {  // one work item's running state for each of its R = rows * group query vectors
  float* max;
  float* sum;
  float* acc;  // [R, D]
};

// Item arguments shared by both item kernels.
template <typename T>
struct ItemArgs {
  const T* q;  // the sequence's first query row
  int64_t q_row_stride, q_head_stride;
  const T* k_cache;
  const T* v_cache;
  int64_t slot_stride;  // elements between consecutive slots of the cache
  const int32_t* table;  // the sequence's block table
  int64_t block_size, past, group, head_dim;
  float scale;
};

// The cache offsets (elements) of keys k0 .. k0 + n of kv head `kv_head`: one division for the range,
// then block by block.
template <typename T>
inline void key_offsets(const ItemArgs<T>& a, int64_t kv_head, int64_t k0, int64_t n, int64_t* out) {
  int64_t block = k0 / a.block_size, within = k0 - block * a.block_size;
  int64_t base = int64_t(a.table[block]) * a.block_size;
  for (int64_t j = 0; j < n; ++j) {
    out[j] = (base + within) * a.slot_stride + kv_head * a.head_dim;
    if (++within == a.block_size) {
      within = 0;
      if (j + 1 < n) base = int64_t(a.table[++block]) * a.block_size;
    }
  }
}

template <typename T>
void init_item(const Item& it, const ItemArgs<T>& a, Partial st, float* qf) {
  const int64_t R = it.rows * a.group, D = a.head_dim;
  for (int64_t r = 0; r < R; ++r) {  // r = row * group + head within the group
    const T* src = a.q + (it.row0 + r / a.group) * a.q_row_stride + (it.kv_head * a.group + r % a.group) * a.q_head_stride;
    for (int64_t d = 0; d < D; ++d) qf[r * D + d] = to_float(src[d]) * a.scale;
    st.max[r] = -std::numeric_limits<float>::infinity();
    st.sum[r] = 0.f;
    std::fill(st.acc + r * D, st.acc + (r + 1) * D, 0.f);
  }
}

// The keys of this range the tile's row r (0-based within the item) sees: n, or fewer for rows
// whose position comes before the range's last key.
inline int64_t visible(const Item& it, int64_t r_row, int64_t past, int64_t k0, int64_t n) {
  return std::max<int64_t>(0, std::min(n, past + it.row0 + r_row - k0 + 1));
}

// Folds row r's new scores s[0..n) (n_vis of them visible) into its running softmax; s becomes the weights.
template <bool Vector>
inline void softmax_step(float* s, int64_t n, int64_t n_vis, Partial st, int64_t r, int64_t D) {
  if (n_vis == 0) {
    std::fill(s, s + n, 0.f);
    return;
  }
  float m = st.max[r];
  for (int64_t j = 0; j < n_vis; ++j) m = std::max(m, s[j]);
  const float correction = std::exp(st.max[r] - m);
  if constexpr (Vector) {
    const F16 shift = splat(-m);
    for (int64_t j = 0; j < n; j += 16) store16(s + j, exp16(add16(load16(s + j), shift)));
  } else {
    for (int64_t j = 0; j < n_vis; ++j) s[j] = std::exp(s[j] - m);
  }
  std::fill(s + n_vis, s + n, 0.f);
  float total = 0.f;
  for (int64_t j = 0; j < n_vis; ++j) total += s[j];
  st.sum[r] = st.sum[r] * correction + total;
  st.max[r] = m;
  if (correction != 1.f) {
    float* acc = st.acc + r * D;
    for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
  }
}

// Any head_dim: one key at a time.
template <typename T>
void run_item_scalar(const Item& it, const ItemArgs<T>& a, Partial st, float* qf, float* kf, float* scores) {
  const int64_t R = it.rows * a.group, D = a.head_dim;
  init_item(it, a, st, qf);
  const int64_t key_end = std::min(it.key1, a.past + it.row0 + it.rows);
  for (int64_t k0 = it.key0; k0 < key_end; k0 += SUB) {
    const int64_t n = std::min(SUB, key_end - k0);
    int64_t offsets[SUB];
    key_offsets(a, it.kv_head, k0, n, offsets);
    for (int64_t j = 0; j < n; ++j) {
      const T* kp = a.k_cache + offsets[j];
      for (int64_t d = 0; d < D; ++d) kf[d] = to_float(kp[d]);
      for (int64_t r = 0; r < R; ++r) scores[r * SUB + j] = dot(qf + r * D, kf, D);
    }
    for (int64_t r = 0; r < R; ++r)
      softmax_step<false>(scores + r * SUB, n, visible(it, r / a.group, a.past, k0, n), st, r, D);
    for (int64_t j = 0; j < n; ++j) {
      const T* vp = a.v_cache + offsets[j];
      for (int64_t d = 0; d < D; ++d) kf[d] = to_float(vp[d]);
      for (int64_t r = 0; r < R; ++r) {
        const float w = scores[r * SUB + j];
        if (w != 0.f) axpy(st.acc + r * D, w, kf, D);
      }
    }
  }
}

// head_dim = 16 * NV: a range's keys (then values) are converted to float32 once into buf [SUB, D];
// scores take 16 keys at a time per query vector, the weighted values RB query vectors at a time
// with their sums in registers.
template <int NV, int RB>
inline void accumulate_values(float* acc, const float* weights, const float* buf, int64_t n) {
  constexpr int64_t D = 16 * NV;
  F16 sum[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) sum[r][v] = load16(acc + r * D + 16 * v);
  for (int64_t j = 0; j < n; ++j) {
    F16 val[NV];
    for (int v = 0; v < NV; ++v) val[v] = load16(buf + j * D + 16 * v);
    for (int r = 0; r < RB; ++r) {
      const F16 w = splat(weights[r * SUB + j]);
      for (int v = 0; v < NV; ++v) sum[r][v] = fma16(w, val[v], sum[r][v]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) store16(acc + r * D + 16 * v, sum[r][v]);
}

template <typename T, int NV>
void run_item_simd(const Item& it, const ItemArgs<T>& a, Partial st, float* qf, float* buf, float* scores) {
  constexpr int64_t D = 16 * NV;
  const int64_t R = it.rows * a.group;
  init_item(it, a, st, qf);
  const int64_t key_end = std::min(it.key1, a.past + it.row0 + it.rows);
  for (int64_t k0 = it.key0; k0 < key_end; k0 += SUB) {
    const int64_t n = std::min(SUB, key_end - k0);
    int64_t offsets[SUB];
    key_offsets(a, it.kv_head, k0, n, offsets);
    for (int64_t j = 0; j < n; ++j) {
      const T* kp = a.k_cache + offsets[j];
      for (int v = 0; v < NV; ++v) store16(buf + j * D + 16 * v, load16(kp + 16 * v));
    }
    for (int64_t r = 0; r < R; ++r) {
      F16 q[NV];
      for (int v = 0; v < NV; ++v) q[v] = load16(qf + r * D + 16 * v);
      for (int64_t j0 = 0; j0 < n; j0 += 16) {
        F16 dots[16];
        for (int64_t jj = 0; jj < 16; ++jj) {
          F16 d = zero16();
          if (j0 + jj < n)
            for (int v = 0; v < NV; ++v) d = fma16(q[v], load16(buf + (j0 + jj) * D + 16 * v), d);
          dots[jj] = d;
        }
        store16(scores + r * SUB + j0, sum16(dots));
      }
    }
    for (int64_t r = 0; r < R; ++r)
      softmax_step<true>(scores + r * SUB, n, visible(it, r / a.group, a.past, k0, n), st, r, D);
    for (int64_t j = 0; j < n; ++j) {
      const T* vp = a.v_cache + offsets[j];
      for (int v = 0; v < NV; ++v) store16(buf + j * D + 16 * v, load16(vp + 16 * v));
    }
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) accumulate_values<NV, 4>(st.acc + r * D, scores + r * SUB, buf, n);
    switch (R - r) {
      case 3: accumulate_values<NV, 3>(st.acc + r * D, scores + r * SUB, buf, n); break;
      case 2: accumulate_values<NV, 2>(st.acc + r * D, scores + r * SUB, buf, n); break;
      case 1: accumulate_values<NV, 1>(st.acc + r * D, scores + r * SUB, buf, n); break;
      default: break;
    }
  }
}

template <typename T>
void run_item(const Item& it, const ItemArgs<T>& a, Partial st, float* qf, float* buf, float* scores) {
  switch (a.head_dim) {
    case 64: return run_item_simd<T, 4>(it, a, st, qf, buf, scores);
    case 128: return run_item_simd<T, 8>(it, a, st, qf, buf, scores);
    case 96: return run_item_simd<T, 6>(it, a, st, qf, buf, scores);
    case 80: return run_item_simd<T, 5>(it, a, st, qf, buf, scores);
    case 256: return run_item_simd<T, 16>(it, a, st, qf, buf, scores);
    default: return run_item_scalar<T>(it, a, st, qf, buf, scores);
  }
}

}  // namespace

// out [T, H, D], q [T, H, D] (last dim contiguous), k_cache / v_cache [slots, KV, D] contiguous,
// block_tables int32 [B, W], seq_lens int32 [B], query_starts int32 [B + 1].
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_starts,
                     int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_attention: q must be [T, H, D] with contiguous heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "paged_attention: out must be contiguous, shaped and typed like q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "paged_attention: k_cache and v_cache must be contiguous [slots, KV, D] of one shape");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_attention: the cache must hold q's dtype");
  TORCH_CHECK(k_cache.size(2) == q.size(2) && q.size(1) % k_cache.size(1) == 0,
              "paged_attention: head_dim differs or the query heads are not a multiple of the kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_starts.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "paged_attention: block_tables, seq_lens and query_starts must be int32 (block_tables contiguous)");
  TORCH_CHECK(query_starts.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) >= seq_lens.size(0),
              "paged_attention: one row of block_tables and seq_lens per sequence, query_starts one longer");
  const int64_t num_seqs = seq_lens.size(0), heads = q.size(1), D = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads, width = block_tables.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();

  // the work items; split ranges only where rows and heads alone leave threads idle
  std::vector<Item> items;
  int64_t base_items = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t n = starts[b + 1] - starts[b];
    TORCH_CHECK(n >= 0 && lens[b] >= n && (lens[b] + block_size - 1) / block_size <= width,
                message("paged_attention: sequence ", b, " has ", n, " queries, ", lens[b],
                        " tokens and a block table of ", width, " blocks"));
    base_items += kv_heads * ((n + TILE - 1) / TILE);
  }
  const int64_t threads = at::get_num_threads();
  const int64_t want = 4 * threads;
  int64_t num_partials = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t n = starts[b + 1] - starts[b], past = lens[b] - n;
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t row0 = 0; row0 < n; row0 += TILE) {
        const int64_t rows = std::min(TILE, n - row0), keys = past + row0 + rows;
        int64_t splits = 1;
        if (base_items < want) splits = std::max<int64_t>(1, std::min(want / base_items, keys / MIN_SPLIT));
        const int64_t per = (keys + splits - 1) / splits;
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t k0 = s * per, k1 = std::min(keys, k0 + per);
          if (k0 >= k1) break;
          items.push_back({b, h, row0, rows, k0, k1, splits > 1 ? num_partials++ : -1});
        }
      }
    }
  }
  const int64_t R_max = TILE * group;
  std::vector<float> split_buf(num_partials * R_max * (D + 2));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t slot_stride = kv_heads * D;
    // small steps (short contexts) run on one thread: waking the others costs more than they save
    int64_t work = 0;
    for (const Item& it : items) work += (it.key1 - it.key0) * it.rows * group;
    const int64_t grain = work < 4096 ? int64_t(items.size()) : 1;
    at::parallel_for(0, int64_t(items.size()), grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(R_max * D * 2 + SUB * D + R_max * SUB + 2 * R_max);
      float* qf = scratch.data();
      float* own_acc = qf + R_max * D;
      float* buf = own_acc + R_max * D;
      float* scores = buf + SUB * D;
      float* own_max = scores + R_max * SUB;
      float* own_sum = own_max + R_max;
      for (int64_t i = begin; i < end; ++i) {
        const Item& it = items[i];
        const int64_t n = starts[it.seq + 1] - starts[it.seq];
        Partial st{own_max, own_sum, own_acc};
        if (it.partial >= 0) {
          float* base = split_buf.data() + it.partial * R_max * (D + 2);
          st = Partial{base, base + R_max, base + 2 * R_max};
        }
        const ItemArgs<scalar_t> args{qp + starts[it.seq] * q.stride(0), q.stride(0), q.stride(1), kc, vc,
                                      slot_stride, tables + it.seq * width, block_size, lens[it.seq] - n, group, D,
                                      float(scale)};
        run_item<scalar_t>(it, args, st, qf, buf, scores);
        if (it.partial >= 0) continue;
        for (int64_t r = 0; r < it.rows * group; ++r) {
          const float inv = st.sum[r] > 0.f ? 1.f / st.sum[r] : 0.f;
          scalar_t* dst = op + ((starts[it.seq] + it.row0 + r / group) * heads + it.kv_head * group + r % group) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = scalar_t(st.acc[r * D + d] * inv);
        }
      }
    });
    if (num_partials == 0) return;
    // merge the split ranges of each (sequence, kv head, tile): items of one tile are consecutive
    std::vector<std::pair<int64_t, int64_t>> groups;  // [first item, end item)
    for (int64_t i = 0; i < int64_t(items.size());) {
      int64_t j = i + 1;
      while (j < int64_t(items.size()) && items[j].seq == items[i].seq && items[j].kv_head == items[i].kv_head &&
             items[j].row0 == items[i].row0)
        ++j;
      if (items[i].partial >= 0) groups.emplace_back(i, j);
      i = j;
    }
    at::parallel_for(0, int64_t(groups.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(D);
      for (int64_t g = begin; g < end; ++g) {
        const Item& first = items[groups[g].first];
        for (int64_t r = 0; r < first.rows * group; ++r) {
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t i = groups[g].first; i < groups[g].second; ++i)
            m = std::max(m, split_buf[items[i].partial * R_max * (D + 2) + r]);
          float total = 0.f;
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t i = groups[g].first; i < groups[g].second; ++i) {
            const float* base = split_buf.data() + items[i].partial * R_max * (D + 2);
            if (base[r] == -std::numeric_limits<float>::infinity()) continue;
            const float w = std::exp(base[r] - m);
            total += base[R_max + r] * w;
            axpy(acc.data(), w, base + 2 * R_max + r * D, D);
          }
          const float inv = total > 0.f ? 1.f / total : 0.f;
          scalar_t* dst =
              op + ((starts[first.seq] + first.row0 + r / group) * heads + first.kv_head * group + r % group) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = scalar_t(acc[d] * inv);
        }
      }
    });
  });
}

}  // namespace ferrum_cpu
