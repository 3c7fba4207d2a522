// CPU kernels of dynarec's hash index and key-seeded initializer.
//
// Each one computes exactly what its plain-torch twin in dynarec/embedding computes (the tests
// compare them bit for bit); these only avoid materializing [n, bucket_size] and [n, dim]
// intermediates. Parallel over keys with ATen's thread pool.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

namespace {

// SplitMix64's finalizer (a bijection on 64 bits), as dynarec.embedding.initializers.mix64.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

constexpr int64_t kGrain = 2048;

void check_cpu_int64(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kInt64, name, " must be int64");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

// Slot of each query key in a two-choice bucketed index, -1 where absent
// (dynarec.embedding.hash_index.BucketedHashIndex.find).
torch::Tensor find_two_choice(const torch::Tensor& table_keys, const torch::Tensor& occupied,
                              int64_t num_buckets, int64_t bucket_size, const torch::Tensor& query) {
  check_cpu_int64(table_keys, "table_keys");
  check_cpu_int64(query, "query");
  TORCH_CHECK(occupied.scalar_type() == torch::kBool && occupied.is_contiguous(), "occupied must be contiguous bool");
  TORCH_CHECK(table_keys.numel() == num_buckets * bucket_size, "table_keys size != num_buckets * bucket_size");
  auto out = torch::empty_like(query);
  const int64_t* tk = table_keys.data_ptr<int64_t>();
  const bool* occ = occupied.data_ptr<bool>();
  const int64_t* q = query.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  const uint64_t nb = static_cast<uint64_t>(num_buckets);
  at::parallel_for(0, query.numel(), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t key = q[i];
      const uint64_t h = mix64(static_cast<uint64_t>(key));
      const uint64_t buckets[2] = {(h & 0xFFFFFFFFULL) % nb, ((h >> 32) & 0xFFFFFFFFULL) % nb};
      int64_t slot = -1;
      for (int c = 0; c < 2 && slot < 0; ++c) {
        const int64_t base = static_cast<int64_t>(buckets[c]) * bucket_size;
        for (int64_t lane = 0; lane < bucket_size; ++lane) {
          if (tk[base + lane] == key && occ[base + lane]) {
            slot = base + lane;
            break;
          }
        }
      }
      o[i] = slot;
    }
  });
  return out;
}

// The two candidate buckets of each key (dynarec.embedding.hash_index.candidate_buckets).
std::vector<torch::Tensor> candidate_buckets(const torch::Tensor& keys, int64_t num_buckets) {
  check_cpu_int64(keys, "keys");
  auto b1 = torch::empty_like(keys);
  auto b2 = torch::empty_like(keys);
  const int64_t* k = keys.data_ptr<int64_t>();
  int64_t* p1 = b1.data_ptr<int64_t>();
  int64_t* p2 = b2.data_ptr<int64_t>();
  const uint64_t nb = static_cast<uint64_t>(num_buckets);
  at::parallel_for(0, keys.numel(), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t h = mix64(static_cast<uint64_t>(k[i]));
      p1[i] = static_cast<int64_t>((h & 0xFFFFFFFFULL) % nb);
      p2[i] = static_cast<int64_t>(((h >> 32) & 0xFFFFFFFFULL) % nb);
    }
  });
  return {b1, b2};
}

// [n, dim] float64 in (0, 1) from 53 hash bits of (seed, stream, key, column), as
// dynarec.embedding.initializers._uniform01.
torch::Tensor uniform01(const torch::Tensor& keys, int64_t dim, int64_t seed, int64_t stream) {
  check_cpu_int64(keys, "keys");
  auto out = torch::empty({keys.numel(), dim}, keys.options().dtype(torch::kFloat64));
  const int64_t* k = keys.data_ptr<int64_t>();
  double* o = out.data_ptr<double>();
  const uint64_t salt = mix64(static_cast<uint64_t>(seed * 4 + stream));
  constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
  constexpr double kScale = 1.0 / static_cast<double>(1ULL << 53);
  at::parallel_for(0, keys.numel(), kGrain / 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t base = mix64(static_cast<uint64_t>(k[i]) ^ salt);
      for (int64_t c = 0; c < dim; ++c) {
        const uint64_t h = mix64(base + static_cast<uint64_t>(c + 1) * kGolden);
        o[i * dim + c] = (static_cast<double>(h >> 11) + 0.5) * kScale;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("find_two_choice", &find_two_choice, "two-choice bucketed hash find");
  m.def("candidate_buckets", &candidate_buckets, "two candidate buckets per key");
  m.def("uniform01", &uniform01, "key-seeded uniform (0, 1) draws");
}
