// CPU kernels of dynarec: the hash index, the key-seeded initializer, the fused bag update.
//
// Each one computes exactly what its plain-torch twin in dynarec/embedding computes (the tests
// compare them bit for bit); these only avoid materializing [n, bucket_size] and [n, dim]
// intermediates. Parallel over keys with ATen's thread pool.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

// The fused update's optimizer and weight-decay codes: dynarec.optim.kernel's KernelCode and
// WeightDecayCode, passed as -D flags by dynarec/kernels/cpu/__init__.py (cpp_defines()).
#if !defined(DYNAREC_KERNEL_SGD) || !defined(DYNAREC_KERNEL_ADAGRAD) || !defined(DYNAREC_KERNEL_ROWWISE_ADAGRAD) || \
    !defined(DYNAREC_KERNEL_ADAM) || !defined(DYNAREC_WEIGHT_DECAY_NONE) || !defined(DYNAREC_WEIGHT_DECAY_L2) ||  \
    !defined(DYNAREC_WEIGHT_DECAY_DECOUPLED)
#error "compile with dynarec.optim.kernel.cpp_defines()"
#endif

namespace {

// SplitMix64's finalizer (a bijection on 64 bits), as dynarec.kernels.reference.mix64.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

constexpr int64_t kGrain = 2048;

// Prefetches the cache lines of the `bytes` bytes at `p`.
inline void prefetch_span(const void* p, size_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t line = begin & ~uintptr_t{63}; line < begin + bytes; line += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(line));
  }
}

// The two candidate buckets of a key from its mix64 hash `h`: its 32-bit halves modulo `nb`
// (dynarec.kernels.reference.candidate_buckets). With N = uint32_t (nb < 2^32) the modulo is a
// 32-bit division: the same values, a fraction of the 64-bit divide's cost.
template <typename N>
inline std::pair<int64_t, int64_t> two_buckets(uint64_t h, N nb) {
  return {static_cast<int64_t>(static_cast<uint32_t>(h) % nb),
          static_cast<int64_t>(static_cast<uint32_t>(h >> 32) % nb)};
}

// The lane of `key` in the bucket starting at slot `base` (`bs` slots), -1 if absent: tags first,
// the key only where the tag matches. A 16-slot bucket compares its 16 tags in one SSE2 op.
inline int64_t probe_bucket(const uint8_t* tg, const int64_t* tk, int64_t base, int64_t bs, uint8_t tag,
                            int64_t key) {
#if defined(__SSE2__)
  if (bs == 16) {
    const __m128i tags = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tg + base));
    unsigned match = static_cast<unsigned>(
        _mm_movemask_epi8(_mm_cmpeq_epi8(tags, _mm_set1_epi8(static_cast<char>(tag)))));
    while (match) {
      const int lane = __builtin_ctz(match);
      if (tk[base + lane] == key) return lane;
      match &= match - 1;
    }
    return -1;
  }
#endif
  for (int64_t lane = 0; lane < bs; ++lane) {
    if (tg[base + lane] == tag && tk[base + lane] == key) return lane;
  }
  return -1;
}

void check_cpu_int64(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kInt64, name, " must be int64");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// The position of the first of `n` indices outside [0, size), or -1 (the ops that write at indices
// check them all first: a bad one writes nothing, and goes back as a value, not a C++ exception).
int64_t first_outside(const int64_t* ix, int64_t n, int64_t size) {
  for (int64_t i = 0; i < n; ++i) {
    if (ix[i] < 0 || ix[i] >= size) return i;
  }
  return -1;
}

// Each key's partition of a partitioned index (the hash index of a group of tables, a table a
// partition: dynarec.kernels.reference.candidate_buckets): key i hashes into the `count` buckets
// from `base` of its partition. Not partitioned (`part_starts` empty): every key's is the whole
// index, (0, num_buckets).
class KeyPartitions {
 public:
  KeyPartitions(const torch::Tensor& part_starts, const torch::Tensor& key_parts, int64_t num_buckets, int64_t n)
      : whole_(static_cast<uint32_t>(num_buckets)) {
    if (part_starts.numel() == 0) return;
    check_cpu_int64(part_starts, "part_starts");
    check_cpu_int64(key_parts, "key_parts");
    TORCH_CHECK(key_parts.numel() == n, "key_parts must have a value per key");
    const int64_t num_parts = part_starts.numel() - 1;
    starts_ = part_starts.data_ptr<int64_t>();
    parts_ = key_parts.data_ptr<int64_t>();
    TORCH_CHECK(num_parts >= 1 && starts_[0] == 0 && starts_[num_parts] == num_buckets,
                "part_starts must run from 0 to num_buckets");
    for (int64_t p = 0; p < num_parts; ++p) {
      TORCH_CHECK(starts_[p + 1] > starts_[p], "every partition must have a bucket");
    }
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(parts_[i] >= 0 && parts_[i] < num_parts, "key_parts must name partitions");
    }
  }
  // (Whether the index is partitioned goes by `part_starts`: with no keys, key_parts has no data.)
  int64_t base(int64_t i) const { return starts_ == nullptr ? 0 : starts_[parts_[i]]; }
  uint32_t count(int64_t i) const {
    return starts_ == nullptr ? whole_ : static_cast<uint32_t>(starts_[parts_[i] + 1] - starts_[parts_[i]]);
  }
  int64_t part(int64_t i) const { return starts_ == nullptr ? 0 : parts_[i]; }
  bool partitioned() const { return starts_ != nullptr; }

 private:
  const uint32_t whole_;
  const int64_t* starts_ = nullptr;
  const int64_t* parts_ = nullptr;
};

}  // namespace

// (slots, absent): the slot of each query key in a two-choice bucketed index, -1 where absent
// (the dynarec::find op); with `flag`, absent is a [] int32 set to 1 if a key is absent (else [0]).
// A slot matches when its tag (0: empty, else key_tags of its key) and its key both do. A
// partitioned index (`part_starts` and `query_parts` not empty: KeyPartitions) finds each key in
// its partition's buckets, and `absent` is a [P] int32, 1 for each partition with an absent key.
std::vector<torch::Tensor> find_two_choice(const torch::Tensor& table_keys, const torch::Tensor& tags,
                                           int64_t num_buckets, int64_t bucket_size, const torch::Tensor& query,
                                           bool flag, const torch::Tensor& part_starts,
                                           const torch::Tensor& query_parts) {
  check_cpu_int64(table_keys, "table_keys");
  check_cpu_int64(query, "query");
  TORCH_CHECK(tags.scalar_type() == torch::kUInt8 && tags.is_contiguous(), "tags must be contiguous uint8");
  TORCH_CHECK(tags.numel() == table_keys.numel(), "tags and table_keys differ in size");
  TORCH_CHECK(table_keys.numel() == num_buckets * bucket_size, "table_keys size != num_buckets * bucket_size");
  auto out = torch::empty_like(query);
  const int64_t* tk = table_keys.data_ptr<int64_t>();
  const uint8_t* tg = tags.data_ptr<uint8_t>();
  const int64_t* q = query.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  TORCH_CHECK(num_buckets >= 1 && num_buckets <= 0xFFFFFFFFLL, "num_buckets must be in [1, 2^32)");
  const KeyPartitions parts(part_starts, query_parts, num_buckets, query.numel());
  const int64_t num_parts = parts.partitioned() ? part_starts.numel() - 1 : 0;
  auto part_absent = torch::zeros({num_parts}, query.options().dtype(torch::kInt32));
  int32_t* pa = part_absent.data_ptr<int32_t>();
  std::atomic<int32_t> any_absent{0};
  // Each key's hash and buckets are computed once, kAhead keys before its probe, when its tag
  // lines and its first bucket's key lines are prefetched (the probe reads a key where a tag
  // matches: without them that read is a second miss after the tags'; the second bucket's are
  // not: it is read for fewer keys, and prefetching it too measured slower); 32-bit modulo (the
  // hash halves and num_buckets fit in 32 bits). 16 keys ahead: about a memory latency of probes
  // (8 left a find of a table out of cache waiting on its lines).
  constexpr int64_t kAhead = 16;
  at::parallel_for(0, query.numel(), kGrain, [&](int64_t begin, int64_t end) {
    struct Probe {
      int64_t base1, base2;
      uint8_t tag;
    };
    Probe ring[kAhead];
    auto prepare = [&](int64_t i) {
      const uint64_t h = mix64(static_cast<uint64_t>(q[i]));
      Probe& p = ring[i % kAhead];
      const auto [bucket1, bucket2] = two_buckets(h, parts.count(i));
      const int64_t first = parts.base(i);
      p.base1 = (first + bucket1) * bucket_size;
      p.base2 = (first + bucket2) * bucket_size;
      p.tag = (h >> 56) ? static_cast<uint8_t>(h >> 56) : 1;
      __builtin_prefetch(tg + p.base1);
      __builtin_prefetch(tg + p.base2);
      __builtin_prefetch(tk + p.base1);
      __builtin_prefetch(tk + p.base1 + 8);
    };
    bool missed = false;
    for (int64_t i = begin; i < std::min(end, begin + kAhead); ++i) prepare(i);
    for (int64_t i = begin; i < end; ++i) {
      const Probe p = ring[i % kAhead];
      if (i + kAhead < end) prepare(i + kAhead);
      const int64_t key = q[i];
      int64_t lane = probe_bucket(tg, tk, p.base1, bucket_size, p.tag, key);
      int64_t slot = lane >= 0 ? p.base1 + lane : -1;
      if (slot < 0) {
        lane = probe_bucket(tg, tk, p.base2, bucket_size, p.tag, key);
        if (lane >= 0) slot = p.base2 + lane;
      }
      missed = missed || slot < 0;
      if (slot < 0 && num_parts) __atomic_store_n(pa + parts.part(i), 1, __ATOMIC_RELAXED);
      o[i] = slot;
    }
    if (missed) any_absent.store(1, std::memory_order_relaxed);
  });
  if (flag && num_parts) return {out, part_absent};
  auto absent = torch::zeros(flag ? c10::IntArrayRef{} : c10::IntArrayRef{0}, query.options().dtype(torch::kInt32));
  if (flag) absent.fill_(any_absent.load());
  return {out, absent};
}

// The two candidate buckets of each key (the dynarec::candidate_buckets op).
std::vector<torch::Tensor> candidate_buckets(const torch::Tensor& keys, int64_t num_buckets) {
  check_cpu_int64(keys, "keys");
  auto b1 = torch::empty_like(keys);
  auto b2 = torch::empty_like(keys);
  const int64_t* k = keys.data_ptr<int64_t>();
  int64_t* p1 = b1.data_ptr<int64_t>();
  int64_t* p2 = b2.data_ptr<int64_t>();
  const uint64_t nb = static_cast<uint64_t>(num_buckets);
  at::parallel_for(0, keys.numel(), kGrain, [&](int64_t begin, int64_t end) {
    const auto fill = [&](auto divisor) {
      for (int64_t i = begin; i < end; ++i) {
        std::tie(p1[i], p2[i]) = two_buckets(mix64(static_cast<uint64_t>(k[i])), divisor);
      }
    };
    if (nb <= 0xFFFFFFFFULL) {
      fill(static_cast<uint32_t>(nb));
    } else {
      fill(nb);
    }
  });
  return {b1, b2};
}

// The two candidate buckets of each key of a partitioned index, in its partition's buckets.
std::vector<torch::Tensor> partitioned_buckets(const torch::Tensor& keys, const KeyPartitions& parts) {
  auto b1 = torch::empty_like(keys);
  auto b2 = torch::empty_like(keys);
  const int64_t* k = keys.data_ptr<int64_t>();
  int64_t* p1 = b1.data_ptr<int64_t>();
  int64_t* p2 = b2.data_ptr<int64_t>();
  for (int64_t i = 0; i < keys.numel(); ++i) {
    const auto [c1, c2] = two_buckets(mix64(static_cast<uint64_t>(k[i])), parts.count(i));
    p1[i] = parts.base(i) + c1;
    p2[i] = parts.base(i) + c2;
  }
  return {b1, b2};
}

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

// The salt of the draws of (seed, stream): dynarec.kernels.reference.uniform_salt.
inline uint64_t uniform_salt(int64_t seed, int64_t stream) { return mix64(static_cast<uint64_t>(seed * 4 + stream)); }

// Column `c`'s draw in (0, 1) of a key whose base is mix64(key ^ salt): 53 hash bits.
inline double uniform_draw(uint64_t base, int64_t c) {
  constexpr double kScale = 1.0 / static_cast<double>(1ULL << 53);
  const uint64_t h = mix64(base + static_cast<uint64_t>(c + 1) * kGolden);
  return (static_cast<double>(h >> 11) + 0.5) * kScale;
}

// uniform_rows' values of a key whose base is mix64(key ^ salt): float32((2u - 1) * bound) for
// columns [0, dim), the float64 steps rounded one by one as torch's mul_, sub_, mul_ and float() do.
inline void uniform_values(float* out, uint64_t base, int64_t dim, double bound) {
  for (int64_t c = 0; c < dim; ++c) out[c] = static_cast<float>((uniform_draw(base, c) * 2.0 - 1.0) * bound);
}

#if defined(__x86_64__)
// uniform_values compiled for AVX-512 (DQ: 64-bit multiplies and int64 -> float64 conversions),
// where GCC vectorizes its columns, 8 at a time: the same IEEE steps, the same bits; the loop
// alone about 3x as fast as the scalar one (called only where the CPU has it).
__attribute__((target("avx512f,avx512dq,avx512vl"))) void uniform_values_avx512(float* out, uint64_t base, int64_t dim,
                                                                                double bound) {
  uniform_values(out, base, dim, bound);
}
// (__builtin_cpu_init first: a static initializer may run before libgcc's own.)
const bool kHasAVX512DQ = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("avx512dq") != 0 &&
         __builtin_cpu_supports("avx512vl") != 0;
}();
#endif

// uniform_values by the fastest of its builds this CPU runs.
inline void uniform_values_here(float* out, uint64_t base, int64_t dim, double bound) {
#if defined(__x86_64__)
  if (kHasAVX512DQ) return uniform_values_avx512(out, base, dim, bound);
#endif
  uniform_values(out, base, dim, bound);
}

// [n, dim] float64 in (0, 1) from 53 hash bits of (seed, stream, key, column) (the
// dynarec::uniform01 op).
torch::Tensor uniform01(const torch::Tensor& keys, int64_t dim, int64_t seed, int64_t stream) {
  check_cpu_int64(keys, "keys");
  auto out = torch::empty({keys.numel(), dim}, keys.options().dtype(torch::kFloat64));
  const int64_t* k = keys.data_ptr<int64_t>();
  double* o = out.data_ptr<double>();
  const uint64_t salt = uniform_salt(seed, stream);
  at::parallel_for(0, keys.numel(), kGrain / 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t base = mix64(static_cast<uint64_t>(k[i]) ^ salt);
      for (int64_t c = 0; c < dim; ++c) o[i * dim + c] = uniform_draw(base, c);
    }
  });
  return out;
}

// out[rows[i], c] = float32((2u - 1) * bound) in out's dtype (float32, or bf16 / fp16 rounded to
// nearest, ties to even), u = uniform01(keys, dim, seed, stream)[i, c] (the dynarec::uniform_rows
// op: the uniform initializer's rows written in place, no [n, dim] temporaries). `out`: [rows,
// dim] with unit column stride; `rows` distinct. The float64 steps round one by one, as torch's
// mul_, sub_, mul_ and float() do (-ffp-contract=off: no fused multiply-add). Returns -1, or the
// position of the first row outside out (then nothing is written).
int64_t uniform_rows(torch::Tensor out, const torch::Tensor& rows, const torch::Tensor& keys, int64_t seed,
                     int64_t stream, double bound) {
  check_cpu_int64(rows, "rows");
  check_cpu_int64(keys, "keys");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1, "out must be [rows, dim] with unit column stride");
  TORCH_CHECK(rows.numel() == keys.numel(), "rows and keys differ in size");
  const int64_t n = rows.numel(), dim = out.size(1), num_rows = out.size(0), stride = out.stride(0);
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* k = keys.data_ptr<int64_t>();
  if (const int64_t bad = first_outside(r, n, num_rows); bad >= 0) return bad;
  const uint64_t salt = uniform_salt(seed, stream);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "uniform_rows", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain / 32, [&](int64_t begin, int64_t end) {
      std::vector<float> values(dim);
      for (int64_t i = begin; i < end; ++i) {
        if (i + 4 < end) prefetch_span(o + r[i + 4] * stride, dim * sizeof(scalar_t));
        const uint64_t base = mix64(static_cast<uint64_t>(k[i]) ^ salt);
        uniform_values_here(values.data(), base, dim, bound);
        scalar_t* row = o + r[i] * stride;
        for (int64_t c = 0; c < dim; ++c) row[c] = static_cast<scalar_t>(values[c]);
      }
    });
  });
  return -1;
}

// t[rows[i], :] = value for float32 `t` [rows, width] with unit column stride (the
// dynarec::fill_rows op: fresh optimizer states), duplicates allowed (two threads may write one
// row, the same value). Returns -1, or the position of the first row outside t (then nothing is
// written).
int64_t fill_rows(torch::Tensor t, const torch::Tensor& rows, double value) {
  check_cpu_int64(rows, "rows");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.stride(1) == 1,
              "t must be float32 [rows, width] with unit column stride");
  const int64_t n = rows.numel(), width = t.size(1), num_rows = t.size(0), stride = t.stride(0);
  const int64_t* r = rows.data_ptr<int64_t>();
  if (const int64_t bad = first_outside(r, n, num_rows); bad >= 0) return bad;
  float* p = t.data_ptr<float>();
  const float v = static_cast<float>(value);
  constexpr int64_t kAhead = 8;  // rows scattered over a large table: each a miss, overlapped
  at::parallel_for(0, n, kGrain / 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + kAhead < end) prefetch_span(p + r[i + kAhead] * stride, width * sizeof(float));
      std::fill_n(p + r[i] * stride, width, v);
    }
  });
  return -1;
}

constexpr int64_t kSortChunk = 1 << 15;  // the fewest ids a thread of stable_row_order sorts

// The stable sort of `n` row indices (all >= 0): `order` such that rows[order] ascends with equal
// rows in occurrence order, and `sorted` = rows[order] (the permutation a stable sort gives).
// An LSD radix sort of (row << 32 | position) words over the bits of the largest row: a pass of
// at most 11 bits each (one pass of up to 16 bits where the buckets are no more than 4 per id),
// each a count and a scatter, split among the threads by runs of at least kSortChunk ids; in
// place of at::sort's comparison sort, which is several times slower at a step's size.
// Returns -1, or the position of the first negative row (then nothing is sorted): errors go back
// as values, not C++ exceptions (a throw across the extension boundary crashed one torch build).
int64_t stable_row_order(const int64_t* rows, int64_t n, std::vector<int64_t>& order, std::vector<int64_t>& sorted) {
  int64_t max_row = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0) return i;
    max_row = std::max(max_row, rows[i]);
  }
  order.resize(n);
  sorted.resize(n);
  if (max_row >> 32 || n >> 32) {  // beyond any CPU table: the comparison sort
    auto st = at::sort(torch::from_blob(const_cast<int64_t*>(rows), {n}, torch::kInt64), true, 0, false);
    std::memcpy(sorted.data(), std::get<0>(st).contiguous().data_ptr<int64_t>(), n * sizeof(int64_t));
    std::memcpy(order.data(), std::get<1>(st).contiguous().data_ptr<int64_t>(), n * sizeof(int64_t));
    return -1;
  }
  int bits = 0;
  while ((max_row >> bits) != 0) ++bits;
  const bool one_pass = bits <= 16 && (int64_t{1} << bits) <= 4 * n;
  const int passes = one_pass ? 1 : std::max(1, (bits + 10) / 11);
  const int width = std::max(1, (bits + passes - 1) / passes);
  const int64_t radix = int64_t{1} << width;
  // The ids split into `chunks` runs, one a thread: each pass counts each run's digits, and each
  // run scatters its own ids, after those of the runs before it with the same digit (stable).
  // (no more runs than keep their counts, a radix each, within the ids' own count)
  const int64_t chunks = std::max<int64_t>(1, std::min({int64_t{at::get_num_threads()}, n / kSortChunk, n / radix}));
  const auto chunk_begin = [&](int64_t c) { return n * c / chunks; };
  const auto each_chunk = [&](auto&& body) {
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) body(c, chunk_begin(c), chunk_begin(c + 1));
    });
  };
  std::vector<uint64_t> a(n), b(n);
  std::vector<int64_t> start(chunks * radix);  // [chunk][digit]: counts, then where the chunk writes
  std::vector<int64_t> base(radix);  // per digit: where its next run writes
  for (int p = 0; p < passes; ++p) {
    const int shift = 32 + p * width;
    std::fill(start.begin(), start.end(), 0);
    each_chunk([&](int64_t c, int64_t begin, int64_t end) {
      int64_t* st = start.data() + c * radix;
      if (p == 0) {
        for (int64_t i = begin; i < end; ++i) {
          const uint64_t r = static_cast<uint64_t>(rows[i]);
          a[i] = (r << 32) | static_cast<uint64_t>(i);
          ++st[r & (radix - 1)];
        }
      } else {
        for (int64_t i = begin; i < end; ++i) ++st[(a[i] >> shift) & (radix - 1)];
      }
    });
    // A digit's ids go after every smaller digit's, each run's after the runs before it (each
    // loop reads the counts row by row).
    std::fill(base.begin(), base.end(), 0);
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t d = 0; d < radix; ++d) base[d] += start[c * radix + d];
    }
    int64_t sum = 0;
    for (int64_t d = 0; d < radix; ++d) {
      const int64_t count = base[d];
      base[d] = sum;
      sum += count;
    }
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t d = 0; d < radix; ++d) {
        const int64_t count = start[c * radix + d];
        start[c * radix + d] = base[d];
        base[d] += count;
      }
    }
    each_chunk([&](int64_t c, int64_t begin, int64_t end) {
      int64_t* st = start.data() + c * radix;
      for (int64_t i = begin; i < end; ++i) b[st[(a[i] >> shift) & (radix - 1)]++] = a[i];
    });
    a.swap(b);
  }
  each_chunk([&](int64_t, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      sorted[i] = static_cast<int64_t>(a[i] >> 32);
      order[i] = static_cast<int64_t>(a[i] & 0xFFFFFFFFULL);
    }
  });
  return -1;
}

namespace {

// Whether the update has a case for optimizer `opt` with weight-decay mode `wd_mode`.
bool known_update(int64_t opt, int64_t wd_mode) {
  switch (opt) {
    case DYNAREC_KERNEL_SGD:
    case DYNAREC_KERNEL_ADAGRAD:
    case DYNAREC_KERNEL_ROWWISE_ADAGRAD:
    case DYNAREC_KERNEL_ADAM:
      break;
    default:
      return false;
  }
  return wd_mode == DYNAREC_WEIGHT_DECAY_NONE || wd_mode == DYNAREC_WEIGHT_DECAY_L2 ||
         wd_mode == DYNAREC_WEIGHT_DECAY_DECOUPLED;
}

// The optimizer's scalars rounded to float32 the way torch rounds them in the native update (its
// ``alpha`` and ``value`` arguments are computed in double, then cast), so both give the same bits.
struct UpdateScalars {
  float lr, eps, wd, beta1, beta2, c1, c2, decay, bias1, bias2;
  UpdateScalars(double lr_, double eps_, double wd_, double beta1_, double beta2_, double bias1_, double bias2_)
      : lr(static_cast<float>(lr_)), eps(static_cast<float>(eps_)), wd(static_cast<float>(wd_)),
        beta1(static_cast<float>(beta1_)), beta2(static_cast<float>(beta2_)), c1(static_cast<float>(1.0 - beta1_)),
        c2(static_cast<float>(1.0 - beta2_)), decay(static_cast<float>(1.0 - lr_ * wd_)),
        bias1(static_cast<float>(bias1_)), bias2(static_cast<float>(bias2_)) {}
};

// One row's update from its aggregated gradient g[D] (gu: scratch of D floats); one case per
// optimizer code (dynarec.optim.kernel.update_rows is the torch twin, _apply_update the Triton one).
inline void update_row(int64_t opt, int64_t wd_mode, const UpdateScalars& k, int64_t row, int64_t D, const float* g,
                       float* gu, float* w, float* s1, float* s2) {
  switch (opt) {
    case DYNAREC_KERNEL_SGD:
      for (int64_t d = 0; d < D; ++d) w[d] -= k.lr * g[d];
      break;
    case DYNAREC_KERNEL_ADAGRAD: {
      float* h = s1 + row * D;
      for (int64_t d = 0; d < D; ++d) {
        h[d] += g[d] * g[d];
        w[d] -= k.lr * g[d] / (std::sqrt(h[d]) + k.eps);
      }
      break;
    }
    case DYNAREC_KERNEL_ROWWISE_ADAGRAD: {
      float sq = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        gu[d] = wd_mode == DYNAREC_WEIGHT_DECAY_L2 ? g[d] + k.wd * w[d] : g[d];
        sq += gu[d] * gu[d];
      }
      float& h = s1[row];
      h += sq / static_cast<float>(D);
      const float m = k.lr / (std::sqrt(h) + k.eps);
      for (int64_t d = 0; d < D; ++d)
        w[d] = wd_mode == DYNAREC_WEIGHT_DECAY_DECOUPLED ? k.decay * w[d] - m * g[d] : w[d] - m * gu[d];
      break;
    }
    case DYNAREC_KERNEL_ADAM: {
      float* m1 = s1 + row * D;
      float* m2 = s2 + row * D;
      for (int64_t d = 0; d < D; ++d) {
        m1[d] = m1[d] * k.beta1 + k.c1 * g[d];
        m2[d] = m2[d] * k.beta2 + k.c2 * g[d] * g[d];
        float upd = (m1[d] / k.bias1) / (std::sqrt(m2[d] / k.bias2) + k.eps);
        if (wd_mode == DYNAREC_WEIGHT_DECAY_DECOUPLED) upd += k.wd * w[d];
        w[d] -= k.lr * upd;
      }
      break;
    }
  }
}

// murmur3's 32-bit finalizer (dynarec.optim.rounding._fmix32).
inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// A row's hash for its rounding draws, from its int64 key and the step's base
// (dynarec.optim.rounding.rounding_noise; column d draws fmix32(hash * 0x165667B1 + d)).
inline uint32_t rounding_row_hash(int64_t key, uint32_t base) {
  const uint64_t k = static_cast<uint64_t>(key);
  const uint32_t high = fmix32(static_cast<uint32_t>(k >> 32) ^ base);
  return fmix32((static_cast<uint32_t>(k) * 0x27D4EB2Fu) ^ high);
}

// `x` stored in H (c10::BFloat16 or c10::Half) by stochastic rounding with the uniform draw `u`
// (dynarec.optim.rounding.stochastic_round): the neighbour above |x| where u is below the
// fraction of the way to it, else the one below; x itself where H holds it exactly.
template <typename H>
inline H round_stochastic(float x, float u) {
  const H nearest(x);  // round to nearest even, as torch's conversion
  uint16_t lo_bits = nearest.x;
  if (std::fabs(static_cast<float>(nearest)) > std::fabs(x)) lo_bits = static_cast<uint16_t>(lo_bits - 1);
  const uint16_t hi_bits = static_cast<uint16_t>(lo_bits + 1);
  const float lo = static_cast<float>(H(lo_bits, H::from_bits()));
  const float hi = static_cast<float>(H(hi_bits, H::from_bits()));
  return H(u < (x - lo) / (hi - lo) ? hi_bits : lo_bits, H::from_bits());
}

// round_stochastic on x's bits, for a row's values: x's neighbours toward and away from zero in H
// and the fraction of the way between them read from its bits (bf16: float32's top half; fp16: x
// in its normal range), compared with the draw's top 24 bits as integers: the bits of
// round_stochastic(x, (draw >> 8) / 2^24) (the fraction and the draw are exact there). Sets
// `general` where that does not hold (a neighbour not finite, x outside fp16's normal range):
// those values take round_stochastic itself. No branch: a row's loop over it vectorizes.
template <typename H>
inline uint16_t rounded_bits(float x, uint32_t draw, uint32_t& general) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  const uint32_t r = draw >> 8;
  uint32_t lo, below;  // the neighbour toward zero; x's bits below it, scaled to 24 bits
  if constexpr (std::is_same_v<H, c10::BFloat16>) {
    lo = b >> 16;
    below = (b & 0xFFFFu) << 8;
    general = ((lo & 0x7F80u) == 0x7F80u) | (((lo + 1) & 0x7F80u) == 0x7F80u);
  } else {
    const uint32_t e = (b >> 23) & 0xFFu;  // biased: fp16's normal range is 113..142
    const uint32_t zero = (b & 0x7FFFFFFFu) == 0;  // +-0 stays itself
    const uint32_t sign = (b >> 16) & 0x8000u;
    lo = zero ? sign : sign | (((e - 112) & 0x1Fu) << 10) | ((b >> 13) & 0x3FFu);
    below = zero ? 0 : (b & 0x1FFFu) << 11;
    general = !zero & ((e < 113) | (e > 142) | (((lo + 1) & 0x7C00u) == 0x7C00u));
  }
  return static_cast<uint16_t>(lo + (r < below));
}

// A row's `D` values rounded into their storage type W's bits by rounded_bits, each with its draw
// from the row's hash `h`; returns whether some value takes round_stochastic itself.
template <typename W>
__attribute__((always_inline)) inline uint32_t round_row(uint16_t* bits, const float* values, int64_t D, uint32_t h) {
  uint32_t any_general = 0;
  for (int64_t d = 0; d < D; ++d) {
    uint32_t general;
    bits[d] = rounded_bits<W>(values[d], fmix32(h * 0x165667B1u + static_cast<uint32_t>(d)), general);
    any_general |= general;
  }
  return any_general;
}

#if defined(__x86_64__)
// round_row compiled for AVX2 (8 values a vector), called only where the CPU has it.
template <typename W>
__attribute__((target("avx2"))) uint32_t round_row_avx2(uint16_t* bits, const float* values, int64_t D, uint32_t h) {
  return round_row<W>(bits, values, D, h);
}
// (__builtin_cpu_init first: a static initializer may run before libgcc's own.)
const bool kHasAVX2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") != 0;
}();

// n float16 values as float32 by F16C's conversion, 8 at a time (compiled for F16C alone: called
// only where the CPU has it).
__attribute__((target("avx,f16c"))) void half_to_float_f16c(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i].x);
}
const bool kHasF16C = [] {  // (AVX too: the conversion stores 256-bit vectors)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx") != 0 && __builtin_cpu_supports("f16c") != 0;
}();
#endif

// n half-precision values as float32 (exactly: each is a float32).
inline void to_float(const c10::Half* src, float* dst, int64_t n) {
#if defined(__x86_64__)
  if (kHasF16C) return half_to_float_f16c(src, dst, n);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// The rows of a fused update in their storage type W: float32 rows are updated in place; half
// rows (c10::BFloat16 / c10::Half) are read into float32, updated there and stored back by
// stochastic rounding, each row's draws keyed by its key (`keys[row]`, or `row + key_offset`).
template <typename W>
struct RowAccess {
  W* rows;
  int64_t D;
  const int64_t* keys;
  int64_t key_offset;
  uint32_t base;

  // The row's float32 values to update: the row itself (float32) or `scratch` filled from it.
  float* load(int64_t row, float* scratch) const {
    if constexpr (std::is_same_v<W, float>) {
      return rows + row * D;
    } else {
      to_float(rows + row * D, scratch, D);
      return scratch;
    }
  }

  void store(int64_t row, const float* values) const {
    if constexpr (!std::is_same_v<W, float>) {
      const uint32_t h = rounding_row_hash(keys ? keys[row] : row + key_offset, base);
      W* w = rows + row * D;
      uint16_t* bits = reinterpret_cast<uint16_t*>(w);
#if defined(__x86_64__)
      const uint32_t any_general = kHasAVX2 ? round_row_avx2<W>(bits, values, D, h) : round_row<W>(bits, values, D, h);
#else
      const uint32_t any_general = round_row<W>(bits, values, D, h);
#endif
      for (int64_t d = 0; any_general && d < D; ++d) {  // rare: NaN, infinities, the range's ends
        const uint32_t draw = fmix32(h * 0x165667B1u + static_cast<uint32_t>(d));
        uint32_t general;
        rounded_bits<W>(values[d], draw, general);
        if (general) w[d] = round_stochastic<W>(values[d], static_cast<float>(draw >> 8) * (1.0f / 16777216.0f));
      }
    }
  }
};

}  // namespace

// The fused backward + update of weighted-sum bags (the dynarec::bag_update op): the ids sorted
// once by row (stable); each run of equal rows sums its occurrences' gradients (psw[i] *
// grad_out[bag(i)], in sorted order) and applies the optimizer `opt` (a KernelCode, weight decay
// `wd_mode` a WeightDecayCode) to the row's weight and states in place. No [n, D] or [U, D]
// intermediate; rows are independent, so threads split them with no atomics. scores (int64,
// optional): scores[row] = score for each updated row.
// Returns -1; or the position of a negative row; or -2 where `opt` / `wd_mode` has no case. Then
// nothing is written.
int64_t fused_bag_update(torch::Tensor weight, torch::Tensor state1, torch::Tensor state2, const torch::Tensor& grad_out,
                         const torch::Tensor& rows, const torch::Tensor& offsets, const c10::optional<torch::Tensor>& psw,
                         int64_t opt, int64_t wd_mode, double lr, double eps, double wd, double beta1, double beta2,
                         double bias1, double bias2, const c10::optional<torch::Tensor>& scores, int64_t score,
                         const c10::optional<torch::Tensor>& row_keys, int64_t key_offset, int64_t rounding_base) {
  check_cpu_int64(rows, "rows");
  check_cpu_int64(offsets, "offsets");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.is_contiguous() && (dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kHalf),
              "weight must be contiguous float32, bfloat16 or float16");
  TORCH_CHECK(grad_out.is_contiguous() && grad_out.scalar_type() == torch::kFloat32, "grad_out must be contiguous float32");
  if (!known_update(opt, wd_mode)) return -2;
  const int64_t n = rows.numel();
  const int64_t D = weight.size(1);
  const int64_t num_bags = offsets.numel() - 1;
  if (n == 0) return -1;
  const int64_t* off = offsets.data_ptr<int64_t>();
  std::vector<int64_t> bag(n);
  for (int64_t b = 0; b < num_bags; ++b)
    for (int64_t i = off[b]; i < off[b + 1]; ++i) bag[i] = b;
  std::vector<int64_t> order_v, srow_v;
  const int64_t negative = stable_row_order(rows.data_ptr<int64_t>(), n, order_v, srow_v);
  if (negative >= 0) return negative;
  const int64_t* srow = srow_v.data();
  const int64_t* order = order_v.data();
  std::vector<int64_t> heads;
  heads.reserve(n + 1);
  for (int64_t q = 0; q < n; ++q)
    if (q == 0 || srow[q] != srow[q - 1]) heads.push_back(q);
  heads.push_back(n);
  const int64_t segments = static_cast<int64_t>(heads.size()) - 1;
  float* s1 = state1.numel() ? state1.data_ptr<float>() : nullptr;
  float* s2 = state2.numel() ? state2.data_ptr<float>() : nullptr;
  const float* go = grad_out.data_ptr<float>();
  torch::Tensor psw_c;
  const float* pw = nullptr;
  if (psw.has_value()) {
    psw_c = psw->contiguous();
    pw = psw_c.data_ptr<float>();
  }
  int64_t* sc = nullptr;
  if (scores.has_value()) {
    check_cpu_int64(*scores, "scores");
    TORCH_CHECK(scores->numel() >= weight.size(0), "scores must have a score per row");
    sc = scores->data_ptr<int64_t>();
  }
  const int64_t* keys = nullptr;
  if (row_keys.has_value()) {
    check_cpu_int64(*row_keys, "row_keys");
    TORCH_CHECK(row_keys->numel() >= weight.size(0), "row_keys must hold a key per row");
    keys = row_keys->data_ptr<int64_t>();
  }
  // Each sorted occurrence's bag and weight, gathered once (independent loads, many in flight)
  // rather than through `order` inside the update, where they were a dependent miss each.
  std::vector<int64_t> sbag_v(n);
  std::vector<float> spw_v(pw ? n : 0);
  int64_t* sbag = sbag_v.data();
  float* spw = spw_v.data();
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int64_t i = order[q];
      sbag[q] = bag[i];
      if (pw) spw[q] = pw[i];
    }
  });
  const UpdateScalars k(lr, eps, wd, beta1, beta2, bias1, bias2);
  auto run = [&](auto* w_all) {
    using W = std::remove_pointer_t<decltype(w_all)>;
    const RowAccess<W> access{w_all, D, keys, key_offset, static_cast<uint32_t>(rounding_base)};
    // A row's weight, states and score, read (written) by its update a few rows on: their misses
    // overlap (a half-precision row is converted before its states are read).
    const int64_t s1_width = opt == DYNAREC_KERNEL_ROWWISE_ADAGRAD ? 1 : D;
    constexpr int64_t kAhead = 4;
    at::parallel_for(0, segments, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> g(D), gu(D), w_row(D);
      for (int64_t s = begin; s < end; ++s) {
        if (s + kAhead < end) {
          const int64_t ahead = srow[heads[s + kAhead]];
          prefetch_span(w_all + ahead * D, D * sizeof(W));
          if (s1) prefetch_span(s1 + ahead * s1_width, s1_width * sizeof(float));
          if (s2) prefetch_span(s2 + ahead * D, D * sizeof(float));
          if (sc) __builtin_prefetch(sc + ahead, 1);
          // (a hot row's first few: its others come while they are summed)
          const int64_t from = heads[s + kAhead];
          for (int64_t q = from; q < std::min(heads[s + kAhead + 1], from + kAhead); ++q) {
            prefetch_span(go + sbag[q] * D, D * sizeof(float));
          }
        }
        std::fill(g.begin(), g.end(), 0.0f);
        for (int64_t q = heads[s]; q < heads[s + 1]; ++q) {
          const float* gr = go + sbag[q] * D;
          const float scale = pw ? spw[q] : 1.0f;
          for (int64_t d = 0; d < D; ++d) g[d] += gr[d] * scale;
        }
        const int64_t row = srow[heads[s]];
        if (sc) sc[row] = score;
        float* w = access.load(row, w_row.data());
        update_row(opt, wd_mode, k, row, D, g.data(), gu.data(), w, s1, s2);
        access.store(row, w);
      }
    });
  };
  if (dtype == torch::kBFloat16) {
    run(weight.data_ptr<c10::BFloat16>());
  } else if (dtype == torch::kHalf) {
    run(weight.data_ptr<c10::Half>());
  } else {
    run(weight.data_ptr<float>());
  }
  return -1;
}

namespace {

#if defined(__x86_64__)
// 8 values of a half-precision row as float32 (exact).
__attribute__((target("avx2,f16c"))) inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
__attribute__((target("avx2,f16c"))) inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Columns [c, c + 8N) of one bag's weighted sum of rows (ids [begin, end) of `r`) into `acc`,
// held in N registers over the bag's ids: each column summed in the ids' order, a multiply then
// an add (no fused multiply-add), as the scalar loop sums it.
template <int N, typename W>
__attribute__((target("avx2,f16c"))) inline void bag_columns(const W* w_all, const int64_t* r, const float* pw,
                                                             int64_t begin, int64_t end, int64_t D, int64_t c,
                                                             float* acc) {
  __m256 sum[N];
  for (int j = 0; j < N; ++j) sum[j] = _mm256_setzero_ps();
  for (int64_t i = begin; i < end; ++i) {
    const W* w = w_all + r[i] * D + c;
    const __m256 scale = _mm256_set1_ps(pw ? pw[i] : 1.0f);
    for (int j = 0; j < N; ++j) sum[j] = _mm256_add_ps(sum[j], _mm256_mul_ps(scale, load8(w + 8 * j)));
  }
  for (int j = 0; j < N; ++j) _mm256_storeu_ps(acc + c + 8 * j, sum[j]);
}

// One bag's weighted sum (D a multiple of 8), 64 columns at a time; the rows of the ids 8 on
// (up to `last`) prefetched on the first pass.
template <typename W>
__attribute__((target("avx2,f16c"))) void bag_sum_avx2(const W* w_all, const int64_t* r, const float* pw,
                                                       int64_t begin, int64_t end, int64_t last, int64_t D,
                                                       float* acc) {
  for (int64_t i = begin; i < end && i + 8 < last; ++i) prefetch_span(w_all + r[i + 8] * D, D * sizeof(W));
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) bag_columns<8>(w_all, r, pw, begin, end, D, c, acc);
  for (; c < D; c += 8) bag_columns<1>(w_all, r, pw, begin, end, D, c, acc);
}
#endif

}  // namespace

// Weighted-sum bags of half-precision rows (the dynarec::pooled op for a bf16 / fp16 weight):
// out[b] = sum_{i in bag b} psw[i] * float(weight[rows[i]]), [num_bags, D] float32, each bag
// summed in float32 in its ids' order. Rows are not checked (the caller's ids are in range).
torch::Tensor pooled_half(const torch::Tensor& weight, const torch::Tensor& rows, const torch::Tensor& offsets,
                          const c10::optional<torch::Tensor>& psw) {
  check_cpu_int64(rows, "rows");
  check_cpu_int64(offsets, "offsets");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.is_contiguous() && (dtype == torch::kBFloat16 || dtype == torch::kHalf),
              "weight must be contiguous bfloat16 or float16");
  const int64_t D = weight.size(1);
  const int64_t num_bags = offsets.numel() - 1;
  auto out = torch::zeros({num_bags, D}, weight.options().dtype(torch::kFloat32));
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* r = rows.data_ptr<int64_t>();
  torch::Tensor psw_c;
  const float* pw = nullptr;
  if (psw.has_value()) {
    psw_c = psw->contiguous();
    pw = psw_c.data_ptr<float>();
  }
  float* o = out.data_ptr<float>();
  auto run = [&](const auto* w_all) {
    at::parallel_for(0, num_bags, 256, [&](int64_t begin, int64_t end) {
      std::vector<float> row(D);
      const int64_t last = off[end];  // the rows of ids a few on are prefetched: their misses overlap
      for (int64_t b = begin; b < end; ++b) {
        float* acc = o + b * D;
#if defined(__x86_64__)
        if (kHasAVX2 && kHasF16C && D % 8 == 0) {
          bag_sum_avx2(w_all, r, pw, off[b], off[b + 1], last, D, acc);
          continue;
        }
#endif
        for (int64_t i = off[b]; i < off[b + 1]; ++i) {
          if (i + 8 < last) prefetch_span(w_all + r[i + 8] * D, D * sizeof(*w_all));
          to_float(w_all + r[i] * D, row.data(), D);
          const float scale = pw ? pw[i] : 1.0f;
          for (int64_t d = 0; d < D; ++d) acc[d] += scale * row[d];
        }
      }
    });
  };
  if (dtype == torch::kBFloat16) {
    run(weight.data_ptr<c10::BFloat16>());
  } else {
    run(weight.data_ptr<c10::Half>());
  }
  return out;
}

namespace {

// The buckets one insert plan touches, in a flat open-addressing table (no allocation per
// bucket): each with its occupied lanes (from the tags, read once), the lanes the plan gave away
// (`claimed`: a new key's slot, a moved resident's old and new slot), and how many keys chose it
// in the current round. Nothing is written to the index.
class PlanBuckets {
 public:
  struct Entry {
    int64_t bucket = -1;  // -1: an empty entry
    uint64_t occupied = 0;
    uint64_t claimed = 0;
    uint64_t seen = 0;   // lanes already taken as a source this round (step 2)
    int32_t round = -1;  // the round `chosen` and `seen` are of
    int32_t chosen = 0;
    int64_t lowest = kUnknown;  // step 3: the lowest (score, slot) held slot it may evict (-1: none)
  };
  static constexpr int64_t kUnknown = -2;  // `lowest` not found since the bucket's last claim

  // Sized for the buckets `keys` keys can touch first (two each, at most `num_buckets`); it
  // grows when moves bring in more. Where that table would have as many entries as the index
  // has buckets, it is an array of an entry a bucket instead (`direct_`: no probing, no growth).
  PlanBuckets(const uint8_t* tags, int64_t bucket_size, int64_t num_buckets, int64_t keys)
      : tags_(tags), bs_(bucket_size), all_(bucket_size == 64 ? ~0ULL : ((1ULL << bucket_size) - 1)) {
    const size_t want = 2 * static_cast<size_t>(std::min(2 * keys, num_buckets));  // load at most 1/2
    size_t cap = 16;
    while (cap < want) cap <<= 1;
    direct_ = static_cast<size_t>(num_buckets) <= cap;
    if (direct_) {
      table_.assign(num_buckets, Entry{});
    } else {
      resize(cap);
    }
  }

  // Marks the buckets with an empty lane (a zero tag) before any claim: free_in of any other
  // bucket is then 0 without adding its entry (a plan's claims only ever take lanes, so a bucket
  // full at the start stays full). Worth its scan of every tag when few lanes are free: a full
  // table's plan otherwise adds an entry for each of its keys' buckets and their residents'
  // other buckets, to find them full.
  void mark_free_buckets(int64_t num_buckets) {
    free_buckets_.assign((num_buckets + 63) / 64, 0);
    const uint8_t* const end = tags_ + num_buckets * bs_;
    for (const uint8_t* p = tags_; p < end;) {
      const void* zero = std::memchr(p, 0, end - p);
      if (zero == nullptr) break;
      const int64_t bucket = (static_cast<const uint8_t*>(zero) - tags_) / bs_;
      free_buckets_[bucket / 64] |= 1ULL << (bucket % 64);
      p = tags_ + (bucket + 1) * bs_;
    }
  }

  // The entry of `bucket` (added on first use). A reference holds only until the next call.
  Entry& at(int64_t bucket) {
    if (direct_) {
      Entry& e = table_[bucket];
      if (e.bucket == -1) fill(e, bucket);
      return e;
    }
    size_t i = home(bucket);
    while (table_[i].bucket != bucket && table_[i].bucket != -1) i = (i + 1) & (table_.size() - 1);
    if (table_[i].bucket == -1) {
      if (2 * (size_ + 1) > table_.size()) {  // keep the load under 1/2
        grow();
        return at(bucket);
      }
      fill(table_[i], bucket);
      ++size_;
    }
    return table_[i];
  }

  void prefetch(int64_t bucket) const {  // its tags and its entry, read a few keys later
    __builtin_prefetch(tags_ + bucket * bs_);
    __builtin_prefetch(&table_[direct_ ? bucket : home(bucket)]);
  }

  int64_t free_in(int64_t bucket) {
    if (!free_buckets_.empty() && !(free_buckets_[bucket / 64] >> (bucket % 64) & 1)) return 0;
    const Entry& e = at(bucket);
    return bs_ - __builtin_popcountll(e.occupied | e.claimed);
  }

  // The lanes of `bucket` occupied and not given away by this plan.
  uint64_t held_lanes(int64_t bucket) {
    const Entry& e = at(bucket);
    return e.occupied & ~e.claimed;
  }

  // Claims the lowest free lane of `bucket`; returns its slot.
  int64_t claim_lowest_free(int64_t bucket) {
    Entry& e = at(bucket);
    const int lane = __builtin_ctzll(~(e.occupied | e.claimed) & all_);
    e.claimed |= 1ULL << lane;
    return bucket * bs_ + lane;
  }

  // Claims a held lane (a moved or evicted resident's).
  void claim(int64_t slot) {
    Entry& e = at(slot / bs_);
    e.claimed |= 1ULL << (slot % bs_);
    e.lowest = kUnknown;
  }

  // A round id no entry has seen (rounds of every step of a plan count on).
  int32_t new_round() { return rounds_++; }

  // The entry of `bucket`, its round counters reset if they are of another round.
  Entry& in_round(int64_t bucket, int32_t round) {
    Entry& e = at(bucket);
    if (e.round != round) e.round = round, e.chosen = 0, e.seen = 0;
    return e;
  }

  // Occupied and not given away by this plan.
  bool held(int64_t slot) {
    const Entry& e = at(slot / bs_);
    const uint64_t bit = 1ULL << (slot % bs_);
    return (e.occupied & bit) && !(e.claimed & bit);
  }

 private:
  void fill(Entry& e, int64_t bucket) const {  // a new entry: its occupied lanes from the tags
    e.bucket = bucket;
    for (int64_t lane = 0; lane < bs_; ++lane) {
      if (tags_[bucket * bs_ + lane]) e.occupied |= 1ULL << lane;
    }
  }
  size_t home(int64_t bucket) const {  // the top bits of a Fibonacci hash
    return (static_cast<uint64_t>(bucket) * 0x9E3779B97F4A7C15ULL) >> shift_;
  }
  void resize(size_t cap) {
    table_.assign(cap, Entry{});
    shift_ = 64 - __builtin_ctzll(cap);
    size_ = 0;
  }
  void grow() {
    std::vector<Entry> old;
    old.swap(table_);
    resize(2 * old.size());
    for (const Entry& e : old) {
      if (e.bucket == -1) continue;
      size_t i = home(e.bucket);
      while (table_[i].bucket != -1) i = (i + 1) & (table_.size() - 1);
      table_[i] = e;
      ++size_;
    }
  }

  const uint8_t* tags_;
  const int64_t bs_;
  const uint64_t all_;
  std::vector<Entry> table_;
  bool direct_ = false;
  int shift_ = 0;
  size_t size_ = 0;
  int32_t rounds_ = 0;
  std::vector<uint64_t> free_buckets_;  // mark_free_buckets' bits (empty: not marked)
};

// Step 1 (dynarec.kernels.reference.plan's _claim_free_slots), the same rounds: each round, every
// key still to place (`cur`: key indices, in rank order) takes, from the free counts at the
// round's start, the emptier of its two buckets (ties: the first); the first `free` keys choosing
// a bucket get its free lanes in ascending order, the rest try again next round. Leaves in `cur`
// the keys whose two buckets are both full, in order.
void claim_free(PlanBuckets& work, const int64_t* p1, const int64_t* p2, int64_t* out, std::vector<int64_t>& cur) {
  std::vector<int64_t> next;
  std::vector<std::pair<int64_t, int64_t>> counts;  // per key this round: (free in b1, free in b2)
  while (!cur.empty()) {
    const int32_t round = work.new_round();
    counts.clear();
    bool live = false;
    for (size_t i = 0; i < cur.size(); ++i) {
      if (i + 8 < cur.size()) work.prefetch(p1[cur[i + 8]]), work.prefetch(p2[cur[i + 8]]);
      const int64_t k = cur[i];
      counts.emplace_back(work.free_in(p1[k]), work.free_in(p2[k]));
      live = live || counts.back().first > 0 || counts.back().second > 0;
    }
    if (!live) break;
    next.clear();
    for (size_t i = 0; i < cur.size(); ++i) {
      const int64_t k = cur[i];
      const auto [f1, f2] = counts[i];
      const int64_t choice = f2 > f1 ? p2[k] : p1[k];
      if ((f1 > 0 || f2 > 0) && work.in_round(choice, round).chosen++ < std::max(f1, f2)) {
        out[k] = work.claim_lowest_free(choice);  // in rank order: this round's next free lane
      } else {
        next.push_back(k);
      }
    }
    cur.swap(next);
  }
}

// Whether slot `slot`'s pin (`pins[slot]`, read only when there are steps) is one of `steps`.
inline bool pinned_by(const int32_t* pins, int64_t slot, const std::vector<int64_t>& steps) {
  if (steps.empty()) return false;
  const int64_t pin = pins[slot];
  for (const int64_t step : steps) {
    if (pin == step) return true;
  }
  return false;
}

// Prefetches the cache lines of bucket `bucket`'s values in `values` (`bs` a bucket).
template <typename T>
void prefetch_lanes(const T* values, int64_t bucket, int64_t bs) {
  prefetch_span(values + bucket * bs, bs * sizeof(T));
}

std::vector<int64_t> to_vector(const torch::Tensor& t) {
  check_cpu_int64(t, "steps");
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
}

torch::Tensor to_tensor(const std::vector<int64_t>& v) {
  auto t = torch::empty({static_cast<int64_t>(v.size())}, torch::kInt64);
  std::copy(v.begin(), v.end(), t.data_ptr<int64_t>());
  return t;
}

}  // namespace

// Step 1 of an insert plan alone (the tests compare it with the plain-torch rounds): writes the
// slots of `keys` into `out`; returns the keys (`todo`: indices into keys/out, in rank order)
// whose two buckets are both full, in order. Each key's two buckets are candidate_buckets', so
// every bucket read is one of the index's.
torch::Tensor claim_free_slots(const torch::Tensor& tags, int64_t bucket_size, const torch::Tensor& keys,
                               const torch::Tensor& todo, torch::Tensor& out) {
  TORCH_CHECK(tags.scalar_type() == torch::kUInt8 && tags.is_contiguous(), "tags must be contiguous uint8");
  check_cpu_int64(keys, "keys");
  check_cpu_int64(todo, "todo");
  check_cpu_int64(out, "out");
  TORCH_CHECK(bucket_size >= 1 && bucket_size <= 64, "bucket_size must be in [1, 64]");
  TORCH_CHECK(keys.numel() == out.numel(), "keys and out must have a value per key");
  const int64_t num_buckets = tags.numel() / bucket_size;
  const auto buckets = candidate_buckets(keys, num_buckets);  // each one of the index's, by construction
  PlanBuckets work(tags.data_ptr<uint8_t>(), bucket_size, num_buckets, todo.numel());
  std::vector<int64_t> cur(todo.data_ptr<int64_t>(), todo.data_ptr<int64_t>() + todo.numel());
  claim_free(work, buckets[0].data_ptr<int64_t>(), buckets[1].data_ptr<int64_t>(), out.data_ptr<int64_t>(), cur);
  return to_tensor(cur);
}

// An insert plan's three steps in one call (the dynarec::plan_insert op), the plain-torch
// planner's rounds exactly (the tests compare the plans): 1. free slots (claim_free); 2. a
// resident of one of the key's buckets (first bucket's lanes first) that is not pinned by
// `move_pins` and whose other bucket had a free slot at the round's start moves there (one mover
// per resident, the best-ranked key; then per target bucket as many as it has free slots, lanes
// ascending); 3. when `allow_evict`: the lowest (score, slot) held slot of the key's two buckets
// not pinned by `evict_pins` (two keys wanting one slot: the better-ranked wins, the other tries
// again). Pins are the steps' ids modulo PIN_WRAP. `free_slots`: the index's empty slots when the
// caller knows (-1: unknown); with none, steps 1 and 2 would place nothing and are skipped. Each of
// `new_keys`' two buckets is candidate_buckets' (computed here: one of the index's by
// construction). Writes `out` (a slot per new key); returns (keys left after step 2, in rank
// order; moved_from; moved_to; evicted slots).
std::vector<torch::Tensor> plan_insert(const torch::Tensor& tags, const torch::Tensor& table_keys,
                                       const torch::Tensor& scores, const torch::Tensor& pins, int64_t num_buckets,
                                       int64_t bucket_size, const torch::Tensor& new_keys, const torch::Tensor& order,
                                       torch::Tensor& out, const torch::Tensor& move_pins,
                                       const torch::Tensor& evict_pins, bool allow_evict, int64_t free_slots,
                                       const torch::Tensor& part_starts, const torch::Tensor& key_parts) {
  TORCH_CHECK(tags.device().is_cpu() && tags.scalar_type() == torch::kUInt8 && tags.is_contiguous(),
              "tags must be contiguous uint8 on the CPU");
  TORCH_CHECK(pins.device().is_cpu() && pins.scalar_type() == torch::kInt32 && pins.is_contiguous(),
              "pins must be contiguous int32 on the CPU");
  check_cpu_int64(table_keys, "table_keys");
  check_cpu_int64(scores, "scores");
  check_cpu_int64(new_keys, "new_keys");
  check_cpu_int64(order, "order");
  check_cpu_int64(out, "out");
  TORCH_CHECK(bucket_size >= 1 && bucket_size <= 64, "bucket_size must be in [1, 64]");
  TORCH_CHECK(num_buckets >= 1 && num_buckets <= 0xFFFFFFFFLL, "num_buckets must be in [1, 2^32)");
  const int64_t capacity = num_buckets * bucket_size;
  TORCH_CHECK(tags.numel() == capacity && table_keys.numel() == capacity && scores.numel() == capacity &&
                  pins.numel() == capacity,
              "tags, table_keys, scores and pins must have num_buckets * bucket_size slots");
  TORCH_CHECK(new_keys.numel() == out.numel(), "new_keys and out must have a value per key");
  const KeyPartitions parts(part_starts, key_parts, num_buckets, new_keys.numel());
  // each one of the index's (of the key's partition's), by construction
  const auto buckets = parts.partitioned() ? partitioned_buckets(new_keys, parts) : candidate_buckets(new_keys, num_buckets);
  const int64_t bs = bucket_size;
  const int64_t* p1 = buckets[0].data_ptr<int64_t>();
  const int64_t* p2 = buckets[1].data_ptr<int64_t>();
  const int64_t* tk = table_keys.data_ptr<int64_t>();
  const int64_t* sc = scores.data_ptr<int64_t>();
  const int32_t* pn = pins.data_ptr<int32_t>();
  int64_t* o = out.data_ptr<int64_t>();
  const std::vector<int64_t> no_move = to_vector(move_pins), no_evict = to_vector(evict_pins);
  PlanBuckets work(tags.data_ptr<uint8_t>(), bs, num_buckets, order.numel());
  // Fewer empty lanes than buckets, and a scan of the tags cheaper than the lookups it spares:
  // mark the buckets that have one.
  if (free_slots > 0 && free_slots < num_buckets && capacity <= 64 * order.numel() * (2 + 2 * bs)) {
    work.mark_free_buckets(num_buckets);
  }
  std::vector<int64_t> cur(order.data_ptr<int64_t>(), order.data_ptr<int64_t>() + order.numel());
  if (free_slots != 0) claim_free(work, p1, p2, o, cur);

  // The buckets of key `k`, which a round reads a few keys on: their entries and tags, their
  // residents' `values` (keys or scores) and, where a step pins, their pins.
  const auto prefetch_buckets = [&](int64_t k, const int64_t* values, bool pins) __attribute__((always_inline)) {
    for (const int64_t b : {p1[k], p2[k]}) {
      work.prefetch(b);
      prefetch_lanes(values, b, bs);
      if (pins) prefetch_lanes(pn, b, bs);
    }
  };

  // Step 2: one cuckoo step. Every decision of a round reads the state at its start; the round's
  // claims are made after.
  // A resident of key k's buckets is of k's partition: it hashes into the same buckets.
  const auto other_bucket = [&](int64_t resident, int64_t own, int64_t k) -> int64_t {  // its second only if needed
    const uint64_t h = mix64(static_cast<uint64_t>(resident));
    const uint32_t nb = parts.count(k);
    const int64_t first = parts.base(k);
    const int64_t r1 = first + static_cast<uint32_t>(h) % nb;
    return r1 == own ? first + static_cast<uint32_t>(h >> 32) % nb : r1;
  };
  struct Move {
    int64_t key, src, dst_bucket;
  };
  std::vector<int64_t> moved_from, moved_to, evicted, next;
  std::vector<Move> moves, winners;
  while (free_slots != 0 && !cur.empty()) {
    const int32_t round = work.new_round();
    moves.clear();
    for (size_t i = 0; i < cur.size(); ++i) {
      if (i + 8 < cur.size()) prefetch_buckets(cur[i + 8], tk, !no_move.empty());
      const int64_t k = cur[i];
      bool found = false;
      for (int half = 0; half < 2 && !found; ++half) {  // the first bucket's lanes first, ascending
        const int64_t own = half == 0 ? p1[k] : p2[k];
        for (uint64_t lanes = work.held_lanes(own); lanes != 0; lanes &= lanes - 1) {
          const int64_t slot = own * bs + __builtin_ctzll(lanes);
          if (pinned_by(pn, slot, no_move)) continue;
          const int64_t alt = other_bucket(tk[slot], own, k);
          if (alt == own || work.free_in(alt) <= 0) continue;
          moves.push_back({k, slot, alt});
          found = true;
          break;
        }
      }
    }
    if (moves.empty()) break;
    // One mover per resident (the first, best-ranked), then per target bucket those that fit.
    winners.clear();
    for (const Move& m : moves) {
      PlanBuckets::Entry& from = work.in_round(m.src / bs, round);
      const uint64_t bit = 1ULL << (m.src % bs);
      if (from.seen & bit) continue;
      from.seen |= bit;
      PlanBuckets::Entry& to = work.in_round(m.dst_bucket, round);
      const int64_t rank = to.chosen++;
      if (rank < bs - __builtin_popcountll(to.occupied | to.claimed)) winners.push_back(m);
    }
    if (winners.empty()) break;
    for (const Move& m : winners) {  // targets in rank order: the rank-th free lane of the round's start
      moved_to.push_back(work.claim_lowest_free(m.dst_bucket));
      moved_from.push_back(m.src);
      work.claim(m.src);
      o[m.key] = m.src;
    }
    next.clear();
    for (const int64_t k : cur) {
      if (o[k] < 0) next.push_back(k);
    }
    cur.swap(next);
  }
  auto left = to_tensor(cur);

  // Step 3: eviction of the lowest (score, slot). A bucket's lowest held slot it may evict is
  // found once and kept until a claim in it: a key losing its pick looks again at that bucket only.
  const auto lowest_held = [&](int64_t bucket) {
    PlanBuckets::Entry& e = work.at(bucket);
    if (e.lowest == PlanBuckets::kUnknown) {
      int64_t best = -1, best_score = 0;
      for (uint64_t lanes = e.occupied & ~e.claimed; lanes != 0; lanes &= lanes - 1) {
        const int64_t slot = bucket * bs + __builtin_ctzll(lanes);
        if (pinned_by(pn, slot, no_evict)) continue;
        const int64_t score = sc[slot];
        if (best < 0 || score < best_score) best = slot, best_score = score;  // lanes ascend: ties keep the first
      }
      e.lowest = best;
    }
    return e.lowest;
  };
  std::vector<std::pair<int64_t, int64_t>> picks;  // (key, slot)
  while (allow_evict && !cur.empty()) {
    picks.clear();
    for (size_t i = 0; i < cur.size(); ++i) {
      if (i + 8 < cur.size()) prefetch_buckets(cur[i + 8], sc, !no_evict.empty());
      const int64_t k = cur[i];
      int64_t best = -1;
      for (const int64_t own : {p1[k], p2[k]}) {
        const int64_t slot = lowest_held(own);
        if (slot >= 0 && (best < 0 || sc[slot] < sc[best] || (sc[slot] == sc[best] && slot < best))) best = slot;
      }
      if (best >= 0) picks.emplace_back(k, best);  // a key with no candidate gives up
    }
    if (picks.empty()) break;
    next.clear();
    for (const auto& [k, slot] : picks) {  // picks were made before: a claimed one was taken this round
      if (!work.held(slot)) {
        next.push_back(k);  // a better-ranked key took it: try the next-lowest
        continue;
      }
      work.claim(slot);
      o[k] = slot;
      evicted.push_back(slot);
    }
    cur.swap(next);
  }
  return {left, to_tensor(moved_from), to_tensor(moved_to), to_tensor(evicted)};
}

// t[idx[i]] = value for every i, duplicates allowed (the dynarec::fill_at op: a step's scores);
// one thread, in order (a plain loop, in place of torch's scatter_, which is slower here).
// Returns -1, or the position of the first index outside t (then nothing is written).
int64_t fill_at(torch::Tensor t, const torch::Tensor& idx, int64_t value) {
  check_cpu_int64(t, "t");
  check_cpu_int64(idx, "idx");
  int64_t* p = t.data_ptr<int64_t>();
  const int64_t* ix = idx.data_ptr<int64_t>();
  const int64_t n = idx.numel(), size = t.numel();
  if (const int64_t bad = first_outside(ix, n, size); bad >= 0) return bad;
  for (int64_t i = 0; i < n; ++i) p[ix[i]] = value;
  return -1;
}

// t[slots[i] + offset] = value for every i (the dynarec::fill_slots op: a step's pins), a negative
// slot writing t's last element (the spare an index's pins keep past their slots: -1 is a key
// without a row); int32 or int64 t, duplicates allowed. One thread, in order, no temporary (in
// place of torch's where and index_fill_). Returns -1, or the position of the first slot whose
// element is outside t (then nothing is written).
int64_t fill_slots(torch::Tensor t, const torch::Tensor& slots, int64_t value, int64_t offset) {
  check_cpu_int64(slots, "slots");
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "t must be a contiguous CPU tensor");
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t n = slots.numel(), size = t.numel();
  const auto at = [&](int64_t i) { return s[i] < 0 ? size - 1 : s[i] + offset; };
  for (int64_t i = 0; i < n; ++i) {
    if (at(i) < 0 || at(i) >= size) return i;
  }
  const auto fill = [&](auto* p) {
    const auto v = static_cast<std::remove_pointer_t<decltype(p)>>(value);
    constexpr int64_t kAhead = 16;  // slots scattered over a large index: each a miss, overlapped
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) __builtin_prefetch(p + at(i + kAhead), 1);
      p[at(i)] = v;
    }
  };
  if (t.scalar_type() == torch::kInt32) {
    fill(t.data_ptr<int32_t>());
  } else {
    TORCH_CHECK(t.scalar_type() == torch::kInt64, "t must be int32 or int64");
    fill(t.data_ptr<int64_t>());
  }
  return -1;
}

// The keys of a find without a row (the dynarec::absent_keys op): the positions of the negative
// `slots` (ascending) and those positions' `keys` as torch.unique(sorted, return_inverse,
// return_counts) gives them: (positions [m], unique [u] ascending, inverse [m], counts [u]). One
// pass over the slots, then a sort of the m absent keys alone, in place of nonzero, an index and
// torch.unique's passes.
std::vector<torch::Tensor> absent_keys(const torch::Tensor& keys, const torch::Tensor& slots) {
  check_cpu_int64(keys, "keys");
  check_cpu_int64(slots, "slots");
  TORCH_CHECK(keys.numel() == slots.numel(), "keys and slots differ in size");
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* s = slots.data_ptr<int64_t>();
  std::vector<int64_t> positions;
  for (int64_t i = 0; i < slots.numel(); ++i) {
    if (s[i] < 0) positions.push_back(i);
  }
  const int64_t m = static_cast<int64_t>(positions.size());
  std::vector<std::pair<int64_t, int64_t>> by_key(m);  // (key, its index among the absent)
  for (int64_t j = 0; j < m; ++j) by_key[j] = {k[positions[j]], j};
  std::sort(by_key.begin(), by_key.end());
  auto inverse = torch::empty({m}, torch::kInt64);
  int64_t* inv = inverse.data_ptr<int64_t>();
  std::vector<int64_t> unique, counts;
  for (int64_t j = 0; j < m; ++j) {
    if (j == 0 || by_key[j].first != by_key[j - 1].first) unique.push_back(by_key[j].first), counts.push_back(0);
    inv[by_key[j].second] = static_cast<int64_t>(unique.size()) - 1;
    ++counts.back();
  }
  return {to_tensor(positions), to_tensor(unique), inverse, to_tensor(counts)};
}

// `slots` with each slot moved_from[i] replaced by moved_to[i] (the dynarec::follow_moves op: a
// plan's cuckoo moves, distinct sources; a negative slot is kept). A bitmap of the sources
// answers most slots (not moved) in one read; a moved one is found by binary search among them.
torch::Tensor follow_moves(const torch::Tensor& slots, const torch::Tensor& moved_from, const torch::Tensor& moved_to) {
  check_cpu_int64(slots, "slots");
  check_cpu_int64(moved_from, "moved_from");
  check_cpu_int64(moved_to, "moved_to");
  TORCH_CHECK(moved_from.numel() == moved_to.numel(), "moved_from and moved_to differ in size");
  const int64_t m = moved_from.numel(), n = slots.numel();
  std::vector<std::pair<int64_t, int64_t>> moves(m);  // (from, to), by source
  for (int64_t j = 0; j < m; ++j) moves[j] = {moved_from.data_ptr<int64_t>()[j], moved_to.data_ptr<int64_t>()[j]};
  std::sort(moves.begin(), moves.end());
  auto out = torch::empty_like(slots);
  const int64_t* s = slots.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t lo = m ? std::max<int64_t>(moves.front().first, 0) : 0, hi = m ? moves.back().first : -1;
  std::vector<uint64_t> moved(hi >= lo ? (hi - lo) / 64 + 1 : 0, 0);  // bit (from - lo): a source
  for (const auto& mv : moves) {
    if (mv.first >= lo) moved[(mv.first - lo) / 64] |= 1ULL << ((mv.first - lo) % 64);
  }
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = s[i];
      o[i] = slot;
      if (slot < lo || slot > hi || !(moved[(slot - lo) / 64] >> ((slot - lo) % 64) & 1)) continue;
      const auto it = std::lower_bound(moves.begin(), moves.end(), std::make_pair(slot, INT64_MIN));
      o[i] = it->second;
    }
  });
  return out;
}

// The dynarec::place_keys op: new_keys[i] with new_scores[i] and its tag into slot slots[i] of an
// index's arrays (distinct, free: key 0 and score 0; -1: not placed; a score of 0 is not written).
// Returns -1, or the position of the first slot outside the arrays (then nothing is written).
int64_t place_keys(torch::Tensor keys, torch::Tensor scores, torch::Tensor tags, const torch::Tensor& slots,
                   const torch::Tensor& new_keys, const torch::Tensor& new_scores) {
  check_cpu_int64(keys, "keys");
  check_cpu_int64(scores, "scores");
  check_cpu_int64(slots, "slots");
  check_cpu_int64(new_keys, "new_keys");
  check_cpu_int64(new_scores, "new_scores");
  TORCH_CHECK(tags.scalar_type() == torch::kUInt8 && tags.is_contiguous(), "tags must be contiguous uint8");
  TORCH_CHECK(slots.numel() == new_keys.numel() && slots.numel() == new_scores.numel(),
              "slots, new_keys and new_scores differ in size");
  int64_t* tk = keys.data_ptr<int64_t>();
  int64_t* ts = scores.data_ptr<int64_t>();
  uint8_t* tg = tags.data_ptr<uint8_t>();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t* k = new_keys.data_ptr<int64_t>();
  const int64_t* sc = new_scores.data_ptr<int64_t>();
  const int64_t n = slots.numel(), size = keys.numel();
  for (int64_t i = 0; i < n; ++i) {
    if (s[i] != -1 && (s[i] < 0 || s[i] >= size)) return i;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (s[i] == -1) continue;
    const uint64_t h = mix64(static_cast<uint64_t>(k[i]));
    tk[s[i]] = k[i];
    if (sc[i] != 0) ts[s[i]] = sc[i];
    tg[s[i]] = (h >> 56) ? static_cast<uint8_t>(h >> 56) : 1;
  }
  return -1;
}

// stable_row_order as tensors: (rows sorted, the permutation), for the tests; empty where a row
// is negative.
std::vector<torch::Tensor> stable_sort_rows(const torch::Tensor& rows) {
  check_cpu_int64(rows, "rows");
  const torch::Tensor r = rows.contiguous();
  std::vector<int64_t> order, sorted;
  if (stable_row_order(r.data_ptr<int64_t>(), r.numel(), order, sorted) >= 0) return {};  // a negative row
  torch::Tensor sorted_t = torch::empty({r.numel()}, torch::kInt64), order_t = torch::empty_like(sorted_t);
  std::memcpy(sorted_t.data_ptr<int64_t>(), sorted.data(), sorted.size() * sizeof(int64_t));
  std::memcpy(order_t.data_ptr<int64_t>(), order.data(), order.size() * sizeof(int64_t));
  return {sorted_t, order_t};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("claim_free_slots", &claim_free_slots, "step 1 of an insert plan: free slots in ranked rounds");
  m.def("plan_insert", &plan_insert, "an insert plan's three steps: free slots, one cuckoo move, eviction");
  m.def("fused_bag_update", &fused_bag_update, "fused backward + optimizer update of weighted-sum bags");
  m.def("pooled_half", &pooled_half, "weighted-sum bags of bf16 / fp16 rows, in float32");
  m.def("stable_sort_rows", &stable_sort_rows, "stable radix sort of row indices: (sorted, order)");
  m.def("fill_at", &fill_at, "t[idx] = value (duplicates allowed); -1 or the first bad position");
  m.def("fill_slots", &fill_slots, "t[slots + offset] = value, -1s at t's last element; -1 or the first bad position");
  m.def("absent_keys", &absent_keys, "positions of the negative slots, their keys unique with inverse and counts");
  m.def("follow_moves", &follow_moves, "slots with a plan's moved sources replaced by their targets");
  m.def("fill_rows", &fill_rows, "t[rows, :] = value (float32 rows); -1 or the first bad position");
  m.def("uniform_rows", &uniform_rows, "the uniform initializer's rows written in place; -1 or the first bad position");
  m.def("place_keys", &place_keys, "new keys with their scores and tags into free slots; -1 or the first bad position");
  m.def("find_two_choice", &find_two_choice, "two-choice bucketed hash find");
  m.def("candidate_buckets", &candidate_buckets, "two candidate buckets per key");
  m.def("uniform01", &uniform01, "key-seeded uniform (0, 1) draws");
}
