// Feature generation for dynarec.data: string ids -> int64 keys with FarmHash Fingerprint64 (or
// libstdc++'s std::hash, TorchEasyRec's default), and separator-joined id lists -> (values,
// lengths), each in one pass over an Arrow string column's bytes (`data`, uint8) and offsets
// (`offsets`, [n + 1] into data; a sliced array's offsets need not start at 0). Their Python twins
// (pyarrow + pyfarmhash, and a Python MurmurHash2) are in dynarec.features.hashing and
// dynarec.data.batch; the tests compare the two bit for bit.
//
// The bindings release the GIL: a batch is built while other Python threads (the trainer's
// read-ahead, a step's Python) run.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace {

// ---- FarmHash Fingerprint64 ----------------------------------------------------------------
// farmhash::Fingerprint64, i.e. farmhashna::Hash64: the hash of TensorFlow's
// tf.strings.to_hash_bucket_fast. Written from FarmHash's algorithm
// (https://github.com/google/farmhash, src/farmhash.cc): FarmHash is Copyright (c) 2014 Google,
// Inc. (by Geoff Pike), under the MIT license. A fingerprint is the same on every platform, so
// words are read little-endian whatever the host's byte order.

constexpr uint64_t k0 = 0xc3a5c85c97cb3127ULL;
constexpr uint64_t k1 = 0xb492b66fbe98f273ULL;
constexpr uint64_t k2 = 0x9ae16a3b2f90404fULL;

inline uint64_t load64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

inline uint64_t load32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap32(v);
#endif
  return v;
}

// Right rotation; every shift used is in 1..63.
inline uint64_t rotate(uint64_t v, int shift) { return (v >> shift) | (v << (64 - shift)); }

inline uint64_t shift_mix(uint64_t v) { return v ^ (v >> 47); }

// Murmur-inspired mix of two words.
inline uint64_t hash_len16(uint64_t u, uint64_t v, uint64_t mul) {
  uint64_t a = (u ^ v) * mul;
  a ^= a >> 47;
  uint64_t b = (v ^ a) * mul;
  b ^= b >> 47;
  return b * mul;
}

inline uint64_t hash_len0to16(const char* s, size_t len) {
  if (len >= 8) {  // two overlapping words
    const uint64_t mul = k2 + len * 2;
    const uint64_t a = load64(s) + k2;
    const uint64_t b = load64(s + len - 8);
    const uint64_t c = rotate(b, 37) * mul + a;
    const uint64_t d = (rotate(a, 25) + b) * mul;
    return hash_len16(c, d, mul);
  }
  if (len >= 4) {  // two overlapping 32-bit words
    const uint64_t mul = k2 + len * 2;
    return hash_len16(len + (load32(s) << 3), load32(s + len - 4), mul);
  }
  if (len > 0) {  // first, middle and last byte; y and z are 32-bit in FarmHash
    const uint32_t a = static_cast<uint8_t>(s[0]);
    const uint32_t b = static_cast<uint8_t>(s[len >> 1]);
    const uint32_t c = static_cast<uint8_t>(s[len - 1]);
    const uint32_t y = a + (b << 8);
    const uint32_t z = static_cast<uint32_t>(len) + (c << 2);
    return shift_mix(y * k2 ^ z * k0) * k2;
  }
  return k2;
}

inline uint64_t hash_len17to32(const char* s, size_t len) {
  const uint64_t mul = k2 + len * 2;
  const uint64_t a = load64(s) * k1;
  const uint64_t b = load64(s + 8);
  const uint64_t c = load64(s + len - 8) * mul;
  const uint64_t d = load64(s + len - 16) * k2;
  return hash_len16(rotate(a + b, 43) + rotate(c, 30) + d, a + rotate(b + k2, 18) + c, mul);
}

struct Pair {
  uint64_t first, second;
};

// A quick 16-byte hash of s[0..31] and the seeds a, b.
inline Pair weak_hash_len32_with_seeds(const char* s, uint64_t a, uint64_t b) {
  const uint64_t w = load64(s), x = load64(s + 8), y = load64(s + 16), z = load64(s + 24);
  a += w;
  b = rotate(b + a + z, 21);
  const uint64_t c = a;
  a += x;
  a += y;
  b += rotate(a, 44);
  return {a + z, b + c};
}

inline uint64_t hash_len33to64(const char* s, size_t len) {
  const uint64_t mul = k2 + len * 2;
  const uint64_t a = load64(s) * k2;
  const uint64_t b = load64(s + 8);
  const uint64_t c = load64(s + len - 8) * mul;
  const uint64_t d = load64(s + len - 16) * k2;
  const uint64_t y = rotate(a + b, 43) + rotate(c, 30) + d;
  const uint64_t z = hash_len16(y, a + rotate(b + k2, 18) + c, mul);
  const uint64_t e = load64(s + 16) * mul;
  const uint64_t f = load64(s + 24);
  const uint64_t g = (y + load64(s + len - 32)) * mul;
  const uint64_t h = (z + load64(s + len - 24)) * mul;
  return hash_len16(rotate(e + f, 43) + rotate(g, 30) + h, e + rotate(f + a, 18) + g, mul);
}

// Over 64 bytes: 64-byte blocks into a 56-byte state (v, w, x, y, z), then the last 64 bytes
// (which overlap the last block unless len is a multiple of 64) with a state-dependent mul.
uint64_t hash_len65plus(const char* s, size_t len) {
  constexpr uint64_t seed = 81;
  uint64_t x = seed * k2 + load64(s);
  uint64_t y = seed * k1 + 113;
  uint64_t z = shift_mix(y * k2 + 113) * k2;
  Pair v{0, 0}, w{0, 0};
  const char* const end = s + ((len - 1) / 64) * 64;
  const char* const last64 = s + len - 64;
  do {
    x = rotate(x + y + v.first + load64(s + 8), 37) * k1;
    y = rotate(y + v.second + load64(s + 48), 42) * k1;
    x ^= w.second;
    y += v.first + load64(s + 40);
    z = rotate(z + w.first, 33) * k1;
    v = weak_hash_len32_with_seeds(s, v.second * k1, x + w.first);
    w = weak_hash_len32_with_seeds(s + 32, z + w.second, y + load64(s + 16));
    std::swap(z, x);
    s += 64;
  } while (s != end);
  const uint64_t mul = k1 + ((z & 0xff) << 1);
  s = last64;
  w.first += (len - 1) & 63;
  v.first += w.first;
  w.first += v.first;
  x = rotate(x + y + v.first + load64(s + 8), 37) * mul;
  y = rotate(y + v.second + load64(s + 48), 42) * mul;
  x ^= w.second * 9;
  y += v.first * 9 + load64(s + 40);
  z = rotate(z + w.first, 33) * mul;
  v = weak_hash_len32_with_seeds(s, v.second * mul, x + w.first);
  w = weak_hash_len32_with_seeds(s + 32, z + w.second, y + load64(s + 16));
  std::swap(z, x);
  return hash_len16(hash_len16(v.first, w.first, mul) + shift_mix(y) * k0 + z,
                    hash_len16(v.second, w.second, mul) + x, mul);
}

inline uint64_t fingerprint64(const char* s, size_t len) {
  if (len <= 16) return hash_len0to16(s, len);
  if (len <= 32) return hash_len17to32(s, len);
  if (len <= 64) return hash_len33to64(s, len);
  return hash_len65plus(s, len);
}

// ---- MurmurHash2, 64-bit: libstdc++'s std::hash<std::string> ---------------------------------
// std::hash<std::string>{}(s) == std::_Hash_bytes(s.data(), s.size(), 0xc70f6907) on a 64-bit
// libstdc++ (libstdc++-v3/libsupc++/hash_bytes.cc): TorchEasyRec's (pyfg's) default string hash.
// Written from that algorithm; words and the tail are read little-endian (what x86-64 and aarch64
// hosts compute), whatever the host's byte order, so a key is the same everywhere.

constexpr uint64_t kMurmurMul = (uint64_t{0xc6a4a793} << 32) + uint64_t{0x5bd1e995};
constexpr uint64_t kStdHashSeed = 0xc70f6907ULL;

inline uint64_t murmur2_64(const char* s, size_t len) {
  const size_t aligned = len & ~size_t{7};
  uint64_t h = kStdHashSeed ^ (len * kMurmurMul);
  for (size_t i = 0; i < aligned; i += 8) {
    h ^= shift_mix(load64(s + i) * kMurmurMul) * kMurmurMul;
    h *= kMurmurMul;
  }
  if (len & 7) {
    uint64_t tail = 0;
    for (size_t i = len; i-- > aligned;) tail = (tail << 8) + static_cast<unsigned char>(s[i]);
    h ^= tail;
    h *= kMurmurMul;
  }
  h = shift_mix(h) * kMurmurMul;
  return shift_mix(h);
}

// The string hash a feature names: 0 FarmHash Fingerprint64, 1 MurmurHash2 (std::hash).
struct Farm {
  uint64_t operator()(const char* s, size_t len) const { return fingerprint64(s, len); }
};
struct Murmur {
  uint64_t operator()(const char* s, size_t len) const { return murmur2_64(s, len); }
};

// Calls f(Farm{}) or f(Murmur{}): the loops are compiled once per hash, with the hash inlined.
template <typename F>
auto with_hash(int64_t function, F&& f) {
  TORCH_CHECK(function == 0 || function == 1, "hash function must be 0 (farmhash) or 1 (murmur2), got ", function);
  return function == 0 ? f(Farm{}) : f(Murmur{});
}

// ---- columns -------------------------------------------------------------------------------

// h % num_buckets (unsigned) without a division: a mask where num_buckets is a power of two
// (2**62: every dynamic table's keys), else Lemire, Kaser & Kurz's direct remainder ("Faster
// remainder by direct computation", 2019): with m = ceil(2**128 / n), h % n is the high 64 bits
// of ((m * h) mod 2**128) * n, exactly for every 64-bit h and 1 < n < 2**64 (their Theorem 1 with
// F = 128 >= N + log2(n), N = 64). The tests compare it with Python's % on many n.
class Buckets {
 public:
  explicit Buckets(int64_t num_buckets) : n_(static_cast<uint64_t>(num_buckets)), pow2_((n_ & (n_ - 1)) == 0) {
    TORCH_CHECK(num_buckets > 0, "num_buckets must be positive, got ", num_buckets);
    m_ = pow2_ ? 0 : ~static_cast<u128>(0) / n_ + 1;
  }
  int64_t operator()(uint64_t h) const {
    if (pow2_) return static_cast<int64_t>(h & (n_ - 1));
    const u128 low = m_ * h;  // mod 2**128
    const u128 high = ((low & ~uint64_t{0}) * n_ >> 64) + (low >> 64) * n_;  // (low * n) >> 64
    return static_cast<int64_t>(high >> 64);
  }

 private:
  using u128 = unsigned __int128;
  uint64_t n_;
  bool pow2_;
  u128 m_;
};

void check_cpu_int64(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kInt64, name, " must be int64");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Checks a string column's buffers and calls f(bytes, offsets, n) with offsets as int32_t* or
// int64_t* (Arrow's string and large_string); every offset is checked to lie in data, ascending.
template <typename F>
auto with_strings(const torch::Tensor& data, const torch::Tensor& offsets, F&& f) {
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == torch::kUInt8 && data.is_contiguous(),
              "data must be contiguous uint8");
  TORCH_CHECK(offsets.device().is_cpu() && offsets.dim() == 1 && offsets.numel() >= 1 && offsets.is_contiguous(),
              "offsets must be a contiguous 1-d tensor of n + 1 offsets");
  const char* d = reinterpret_cast<const char*>(data.data_ptr<uint8_t>());
  const int64_t n = offsets.numel() - 1, size = data.numel();
  const auto checked = [&](const auto* off) {
    TORCH_CHECK(off[0] >= 0 && off[n] <= size, "offsets [", off[0], ", ", off[n], "] outside data of ", size,
                " bytes");
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(off[i] <= off[i + 1], "offsets descend at ", i);
    return f(d, off, n);
  };
  if (offsets.scalar_type() == torch::kInt32) return checked(offsets.data_ptr<int32_t>());
  TORCH_CHECK(offsets.scalar_type() == torch::kInt64, "offsets must be int32 or int64");
  return checked(offsets.data_ptr<int64_t>());
}

// Splits the non-empty field [p, end) at sep (s >= 1 bytes) as pyarrow's split_pattern does (the
// leftmost match, resuming after it) and calls emit(begin, end) on each token, in order; false at
// the first empty token (nothing is emitted after it).
template <typename Emit>
bool split_field(const char* p, const char* end, const char* sep, size_t s, bool drop_empty, Emit&& emit) {
  for (;;) {
    const char* q = end;
    for (const char* at = p; static_cast<size_t>(end - at) >= s;) {
      const void* c = std::memchr(at, sep[0], static_cast<size_t>(end - at) - s + 1);
      if (!c) break;
      at = static_cast<const char*>(c);
      if (std::memcmp(at, sep, s) == 0) {
        q = at;
        break;
      }
      ++at;
    }
    if (q != p) {
      emit(p, q);
    } else if (!drop_empty) {
      return false;
    }
    if (q == end) return true;
    p = q + s;  // at end after a trailing separator: the next token is empty
  }
}

// split_field for a one-byte separator, 16 bytes at a time: a bit mask of the separators in each
// block, its set bits in order. Blocks may read past the field's end (never past data_end: the
// last block of the column is copied), and the mask drops what lies past it.
template <typename Emit>
bool split_field_byte(const char* p, const char* end, const char* data_end, char sep, bool drop_empty, Emit&& emit) {
#if defined(__SSE2__)
  const __m128i needle = _mm_set1_epi8(sep);
  const char* start = p;  // the current token's first byte
  for (const char* block = p; block < end; block += 16) {
    __m128i bytes;
    if (data_end - block >= 16) {
      bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
    } else {
      char tail[16] = {};
      std::memcpy(tail, block, static_cast<size_t>(data_end - block));
      bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tail));
    }
    uint32_t mask = static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(bytes, needle)));
    if (end - block < 16) mask &= (1u << (end - block)) - 1;
    for (; mask; mask &= mask - 1) {
      const char* q = block + __builtin_ctz(mask);
      if (q != start) {
        emit(start, q);
      } else if (!drop_empty) {
        return false;
      }
      start = q + 1;
    }
  }
  if (start != end) {
    emit(start, end);
  } else if (!drop_empty) {
    return false;  // a trailing separator
  }
  return true;
#else
  (void)data_end;
  return split_field(p, end, &sep, 1, drop_empty, emit);
#endif
}

}  // namespace

// The 64-bit hash of every string (int64 [n]: the uint64 hashes' bits): FarmHash Fingerprint64
// (function 0) or std::hash (function 1).
torch::Tensor fingerprint64_strings(const torch::Tensor& data, const torch::Tensor& offsets, int64_t function) {
  return with_hash(function, [&](auto hash) {
    return with_strings(data, offsets, [&](const char* d, const auto* off, int64_t n) {
      auto out = torch::empty({n}, torch::kInt64);
      int64_t* o = out.data_ptr<int64_t>();
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<int64_t>(hash(d + off[i], off[i + 1] - off[i]));
      return out;
    });
  });
}

// tf.strings.to_hash_bucket_fast of every string: fingerprint64(s) % num_buckets, int64 [n] (or
// std::hash(s) % num_buckets with function 1).
torch::Tensor hash_strings(const torch::Tensor& data, const torch::Tensor& offsets, int64_t num_buckets,
                           int64_t function) {
  const Buckets bucket(num_buckets);
  return with_hash(function, [&](auto hash) {
    return with_strings(data, offsets, [&](const char* d, const auto* off, int64_t n) {
      auto out = torch::empty({n}, torch::kInt64);
      int64_t* o = out.data_ptr<int64_t>();
      for (int64_t i = 0; i < n; ++i) o[i] = bucket(hash(d + off[i], off[i + 1] - off[i]));
      return out;
    });
  });
}

// Separator-joined string lists -> (values int64 [tokens], lengths int64 [n], first bad row):
// every token hashed as hash_strings does, in one pass. What dynarec.data.batch does with
// pyarrow's split_pattern then to_hash_bucket_fast: an empty string is an empty list; an empty
// token (a leading, doubled or trailing separator) makes its row bad, or is dropped
// (`drop_empty`). The first bad row's index is returned (values then empty, lengths
// unspecified), else -1.
std::tuple<torch::Tensor, torch::Tensor, int64_t> split_hash(const torch::Tensor& data, const torch::Tensor& offsets,
                                                              const std::string& sep, int64_t num_buckets,
                                                              int64_t function, bool drop_empty) {
  TORCH_CHECK(!sep.empty(), "the separator is empty");
  const Buckets bucket(num_buckets);
  return with_hash(function, [&](auto hash) {
    return with_strings(data, offsets, [&](const char* d, const auto* off, int64_t n) {
      const int64_t s = static_cast<int64_t>(sep.size());
      // k non-empty tokens take at least k + (k - 1) * s bytes of their row: a bound on the tokens.
      const int64_t bound = (static_cast<int64_t>(off[n] - off[0]) + n * s) / (1 + s);
      auto values = torch::empty({bound}, torch::kInt64);
      auto lengths = torch::empty({n}, torch::kInt64);
      int64_t* v = values.data_ptr<int64_t>();
      int64_t* len = lengths.data_ptr<int64_t>();
      int64_t count = 0;
      const auto emit = [&](const char* a, const char* b) { v[count++] = bucket(hash(a, static_cast<size_t>(b - a))); };
      const char* const data_end = d + data.numel();
      for (int64_t r = 0; r < n; ++r) {
        const char* p = d + off[r];
        const char* const end = d + off[r + 1];
        const int64_t first = count;
        if (p != end && !(s == 1 ? split_field_byte(p, end, data_end, sep[0], drop_empty, emit)
                                 : split_field(p, end, sep.data(), sep.size(), drop_empty, emit))) {
          return std::make_tuple(values.narrow(0, 0, 0), lengths, r);
        }
        len[r] = count - first;
      }
      return std::make_tuple(values.narrow(0, 0, count), lengths, static_cast<int64_t>(-1));
    });
  });
}

// Separator-joined decimal int64 lists -> (values, lengths, ok), in one pass over a string
// column's bytes (`data`, uint8) and offsets (`offsets`, int64 [n + 1], into data): what
// dynarec.data.batch does with pyarrow's split_pattern + cast, for the strict common case. An
// empty string is an empty list; empty tokens are dropped with `drop_empty`. ok = false at the
// first thing this parser does not take (an empty token otherwise, anything but an optional '-'
// and digits, an int64 overflow): the caller then takes pyarrow's path, which trims whitespace
// and names a malformed value.
std::tuple<torch::Tensor, torch::Tensor, bool> split_parse_int64(const torch::Tensor& data, const torch::Tensor& offsets,
                                                                const std::string& sep, bool drop_empty) {
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == torch::kUInt8 && data.is_contiguous(),
              "data must be contiguous uint8");
  check_cpu_int64(offsets, "offsets");
  TORCH_CHECK(!sep.empty(), "the separator is empty");
  const int64_t n = offsets.numel() - 1;
  const char* d = reinterpret_cast<const char*>(data.data_ptr<uint8_t>());
  const int64_t* off = offsets.data_ptr<int64_t>();
  auto lengths = torch::empty({std::max<int64_t>(n, 0)}, offsets.options());
  int64_t* len = lengths.data_ptr<int64_t>();
  std::vector<int64_t> values;
  values.reserve(n > 0 ? static_cast<size_t>(off[n] - off[0]) / 2 + 1 : 0);
  const auto fail = [&]() { return std::make_tuple(torch::empty({0}, offsets.options()), lengths, false); };
  constexpr uint64_t kMaxPositive = static_cast<uint64_t>(INT64_MAX);
  for (int64_t r = 0; r < n; ++r) {
    const char* p = d + off[r];
    const char* const end = d + off[r + 1];
    int64_t count = 0;
    while (p < end) {
      if (drop_empty && static_cast<size_t>(end - p) >= sep.size() && std::memcmp(p, sep.data(), sep.size()) == 0) {
        p += sep.size();  // an empty token
        continue;
      }
      const bool negative = *p == '-';
      if (negative) ++p;
      const uint64_t limit = negative ? kMaxPositive + 1 : kMaxPositive;
      const char* const digits = p;
      uint64_t v = 0;
      while (p < end && *p >= '0' && *p <= '9') {
        const uint64_t digit = static_cast<uint64_t>(*p - '0');
        if (v > (limit - digit) / 10) return fail();
        v = v * 10 + digit;
        ++p;
      }
      if (p == digits) return fail();
      values.push_back(negative ? static_cast<int64_t>(0 - v) : static_cast<int64_t>(v));
      ++count;
      if (p == end) break;
      if (static_cast<size_t>(end - p) < sep.size() || std::memcmp(p, sep.data(), sep.size()) != 0) return fail();
      p += sep.size();
      if (p == end && !drop_empty) return fail();  // a trailing separator: an empty last token
    }
    len[r] = count;
  }
  auto out = torch::empty({static_cast<int64_t>(values.size())}, offsets.options());
  std::memcpy(out.data_ptr<int64_t>(), values.data(), values.size() * sizeof(int64_t));
  return std::make_tuple(out, lengths, true);
}

namespace {

// The code points of UTF-8 text (a malformed byte stands for itself).
void utf8_code_points(const char* p, const char* end, std::vector<uint32_t>& out) {
  out.clear();
  const auto* s = reinterpret_cast<const unsigned char*>(p);
  const auto* e = reinterpret_cast<const unsigned char*>(end);
  while (s < e) {
    const unsigned char c = *s;
    const int n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    bool ok = n > 0 && s + n <= e;
    for (int k = 1; ok && k < n; ++k) ok = (s[k] >> 6) == 0x2;
    if (!ok) {
      out.push_back(c);
      ++s;
      continue;
    }
    uint32_t cp = n == 1 ? c : c & (0x7f >> n);
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (s[k] & 0x3f);
    out.push_back(cp);
    s += n;
  }
}

// Levenshtein distance (insertions, deletions, substitutions of cost 1), two rows of the table.
template <typename T>
int64_t levenshtein(const T* a, size_t n, const T* b, size_t m, std::vector<int64_t>& row) {
  row.resize(m + 1);
  for (size_t j = 0; j <= m; ++j) row[j] = static_cast<int64_t>(j);
  for (size_t i = 1; i <= n; ++i) {
    int64_t diagonal = row[0];
    row[0] = static_cast<int64_t>(i);
    for (size_t j = 1; j <= m; ++j) {
      const int64_t up = row[j];
      row[j] = std::min({up + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[m];
}

}  // namespace

// TorchEasyRec's EditDistance operator: the Levenshtein distance of a[i] and b[i] for every row,
// over bytes (encoding latin) or UTF-8 code points (utf8), int64 [n].
torch::Tensor edit_distance(const torch::Tensor& data_a, const torch::Tensor& offsets_a, const torch::Tensor& data_b,
                            const torch::Tensor& offsets_b, bool utf8) {
  TORCH_CHECK(offsets_a.numel() == offsets_b.numel(), "the two columns have different lengths");
  return with_strings(data_a, offsets_a, [&](const char* da, const auto* oa, int64_t n) {
    return with_strings(data_b, offsets_b, [&](const char* db, const auto* ob, int64_t) {
      auto out = torch::empty({n}, torch::kInt64);
      int64_t* o = out.data_ptr<int64_t>();
      std::vector<int64_t> row;
      std::vector<uint32_t> ca, cb;
      for (int64_t i = 0; i < n; ++i) {
        const char *a = da + oa[i], *a_end = da + oa[i + 1], *b = db + ob[i], *b_end = db + ob[i + 1];
        if (utf8) {
          utf8_code_points(a, a_end, ca);
          utf8_code_points(b, b_end, cb);
          o[i] = levenshtein(ca.data(), ca.size(), cb.data(), cb.size(), row);
        } else {
          o[i] = levenshtein(reinterpret_cast<const unsigned char*>(a), static_cast<size_t>(a_end - a),
                             reinterpret_cast<const unsigned char*>(b), static_cast<size_t>(b_end - b), row);
        }
      }
      return out;
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("fingerprint64", &fingerprint64_strings, "the 64-bit hash of every string (0 farmhash, 1 std::hash)",
        py::arg("data"), py::arg("offsets"), py::arg("function") = 0, nogil);
  m.def("hash_strings", &hash_strings, "hash(s) % num_buckets of every string", py::arg("data"), py::arg("offsets"),
        py::arg("num_buckets"), py::arg("function") = 0, nogil);
  m.def("split_hash", &split_hash, "separator-joined string lists, hashed: values, lengths, first bad row",
        py::arg("data"), py::arg("offsets"), py::arg("sep"), py::arg("num_buckets"), py::arg("function") = 0, py::arg("drop_empty") = false, nogil);
  m.def("split_parse_int64", &split_parse_int64, "separator-joined int64 lists: values, lengths, ok", py::arg("data"),
        py::arg("offsets"), py::arg("sep"), py::arg("drop_empty") = false, nogil);
  m.def("edit_distance", &edit_distance, "Levenshtein distance of two string columns, row by row", nogil);
}
