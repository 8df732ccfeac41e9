// Decode-step attention over the filled prefix of a KV cache, as an XLA FFI handler for CPU.
//
// Built and registered by `longhorizon/models/cpu_kernels.py` (compiled with the system C++ compiler
// on first use; the XLA path in `llama._cached_attention` is used when it cannot be built).
//
// Why a kernel: a decode step's attention reads every layer's keys and values. XLA:CPU reads the whole
// cache (all `S` slots) every step, and every way of reading only the filled prefix in XLA (static or
// dynamic slices, chunked caches, per-segment loops) copied the slice or fell off the fast reduction
// path (measured, docs/notes/issue-03.md). Here each row reads only its own `n[b]` visible slots.
//
// Inputs (all float32 except n):
//   q  [B, KV, G, hd]   queries of one new token per row, already scaled by 1/sqrt(hd)
//   k  [B, KV, S, hd]   keys (the cache layout of `llama.KVCache`)
//   v  [B, KV, S, hd]   values
//   n  [B] int32        visible slots per row: the query attends to slots [0, n[b]); 0 <= n[b] <= S
// Output:
//   out [B, KV, G, hd]  softmax(q . k_s) weighted sum of v_s over s < n[b]; zeros where n[b] == 0.
//
// Work is split over (row, kv-head) pairs between the calling thread and XLA's intra-op thread pool.
//
// The same library holds `LhInt8Matmul`, the weight-only int8 matmul of quantised decoding (below).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// exp(x) for x <= 0 (scores minus their maximum), written so the compiler vectorises the loop that
// calls it: Cody-Waite range reduction and a degree-6 polynomial (relative error ~2e-7, like XLA's).
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float kLog2e = 1.44269504088896341f;
  const float kLn2Hi = 0.693359375f;
  const float kLn2Lo = -2.12194440e-4f;
  float k = std::nearbyint(x * kLog2e);
  float r = x - k * kLn2Hi - k * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

struct Dims {
  int64_t b, kv, g, hd, s;
};

// scores[g, s] = q[g, :] . k[s, :] for s < n. The pair's keys are one contiguous [n, hd] block, read
// front to back once (the dot products vectorise: the library is built with -fassociative-math).
template <int G>
void Scores(const float* q, const float* k, int32_t n, int64_t hd, int64_t s_cap, float* scores) {
  for (int32_t s = 0; s < n; ++s) {
    const float* ks = k + s * hd;
    for (int g = 0; g < G; ++g) {
      const float* qg = q + g * hd;
      float total = 0.0f;
      for (int64_t d = 0; d < hd; ++d) total += qg[d] * ks[d];
      scores[g * s_cap + s] = total;
    }
  }
}

// out[g, :] = sum_{s < n} p[g, s] * v[s, :]; the pair's values are read front to back once.
template <int G>
void Values(const float* p, const float* v, int32_t n, int64_t hd, int64_t s_cap, float* out) {
  std::fill(out, out + G * hd, 0.0f);
  for (int32_t s = 0; s < n; ++s) {
    const float* vrow = v + s * hd;
    for (int g = 0; g < G; ++g) {
      const float pg = p[g * s_cap + s];
      float* og = out + g * hd;
      for (int64_t d = 0; d < hd; ++d) og[d] += pg * vrow[d];
    }
  }
}

// Turns scores[g, :n] into exp(score - max) in place; inv_sum[g] = 1 / their sum.
template <int G>
void Softmax(float* scores, int32_t n, int64_t s_cap, float* inv_sum) {
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * s_cap;
    float mx = sg[0];
    for (int32_t s = 1; s < n; ++s) mx = std::max(mx, sg[s]);
    float sum = 0.0f;
    for (int32_t s = 0; s < n; ++s) {
      sg[s] = ExpNonPositive(sg[s] - mx);
      sum += sg[s];
    }
    inv_sum[g] = 1.0f / sum;
  }
}

// One (row, kv-head) pair with G query heads; `scores` is G x S floats of scratch. The generic
// version, for any head size.
template <int G>
void AttendPair(const float* q, const float* k, const float* v, int32_t n, int64_t hd,
                int64_t s_cap, float* out, float* scores) {
  if (n <= 0) {
    std::fill(out, out + G * hd, 0.0f);
    return;
  }
  Scores<G>(q, k, n, hd, s_cap, scores);
  float inv_sum[G];
  Softmax<G>(scores, n, s_cap, inv_sum);
  Values<G>(scores, v, n, hd, s_cap, out);
  for (int g = 0; g < G; ++g) {
    for (int64_t j = 0; j < hd; ++j) out[g * hd + j] *= inv_sum[g];
  }
}

// The same for a head size HD known at compile time, on the compiler's vector type of the target's
// widest registers: queries and the G x HD output accumulators stay in registers while each key and
// value row is loaded once.
#if defined(__AVX512F__)
constexpr int kWidth = 16;
#else
constexpr int kWidth = 8;
#endif
typedef float Vec __attribute__((vector_size(kWidth * sizeof(float)), aligned(4), may_alias));

inline float HorizontalSum(Vec t) {
  float total = 0.0f;
  for (int i = 0; i < kWidth; ++i) total += t[i];
  return total;
}

template <int G, int HD>
void AttendPairFixed(const float* q, const float* k, const float* v, int32_t n, int64_t /*hd*/,
                     int64_t s_cap, float* out, float* scores) {
  constexpr int C = HD / kWidth;
  if (n <= 0) {
    std::fill(out, out + G * HD, 0.0f);
    return;
  }
  Vec qv[G][C];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) qv[g][c] = *reinterpret_cast<const Vec*>(q + g * HD + kWidth * c);
  }
  for (int32_t s = 0; s < n; ++s) {
    const Vec* krow = reinterpret_cast<const Vec*>(k + s * HD);
    Vec kk[C];
    for (int c = 0; c < C; ++c) kk[c] = krow[c];
    for (int g = 0; g < G; ++g) {
      Vec t = qv[g][0] * kk[0];
      for (int c = 1; c < C; ++c) t += qv[g][c] * kk[c];
      scores[g * s_cap + s] = HorizontalSum(t);
    }
  }
  float inv_sum[G];
  Softmax<G>(scores, n, s_cap, inv_sum);
  Vec acc[G][C];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) acc[g][c] = Vec{};
  }
  for (int32_t s = 0; s < n; ++s) {
    const Vec* vrow = reinterpret_cast<const Vec*>(v + s * HD);
    Vec vv[C];
    for (int c = 0; c < C; ++c) vv[c] = vrow[c];
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * s_cap + s];
      for (int c = 0; c < C; ++c) acc[g][c] += p * vv[c];
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) {
      *reinterpret_cast<Vec*>(out + g * HD + kWidth * c) = acc[g][c] * inv_sum[g];
    }
  }
}

using PairFn = void (*)(const float*, const float*, const float*, int32_t, int64_t, int64_t, float*,
                        float*);

// Query heads per kv head (G) and, for the common head sizes, the head size are template
// parameters so the loops unroll onto registers.
template <int G>
PairFn PairForGroup(int64_t hd) {
  if (hd == 64) return AttendPairFixed<G, 64>;
  if (hd == 128) return AttendPairFixed<G, 128>;
  return AttendPair<G>;
}

PairFn PairFor(int64_t g, int64_t hd) {
  switch (g) {
    case 1: return PairForGroup<1>(hd);
    case 2: return PairForGroup<2>(hd);
    case 3: return PairForGroup<3>(hd);
    case 4: return PairForGroup<4>(hd);
    case 5: return PairForGroup<5>(hd);
    case 6: return PairForGroup<6>(hd);
    case 7: return PairForGroup<7>(hd);
    case 8: return PairForGroup<8>(hd);
    default: return nullptr;
  }
}

// Shared by the participants of one call and owned jointly, so a pool task that starts after the
// call returned (and finds no work left) still reads valid memory.
struct Work {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* n;
  float* out;
  Dims d;
  PairFn pair;
  int64_t pairs;
  int64_t chunk;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Claims chunks of pairs until none is left.
void RunChunks(Work& w) {
  const Dims& d = w.d;
  std::vector<float> scores(static_cast<size_t>(d.g * d.s));
  for (;;) {
    const int64_t start = w.next.fetch_add(w.chunk);
    if (start >= w.pairs) return;
    const int64_t stop = std::min(start + w.chunk, w.pairs);
    for (int64_t p = start; p < stop; ++p) {
      const int32_t n = std::clamp<int32_t>(w.n[p / d.kv], 0, static_cast<int32_t>(d.s));
      w.pair(w.q + p * d.g * d.hd, w.k + p * d.s * d.hd, w.v + p * d.s * d.hd, n, d.hd, d.s,
             w.out + p * d.g * d.hd, scores.data());
    }
    w.done.fetch_add(stop - start);
  }
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                               ffi::Buffer<ffi::S32> n, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), nd = n.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || nd.size() != 1) {
    return ffi::Error::InvalidArgument(
        "decode_attention expects q[B,KV,G,hd], k[B,KV,S,hd], v[B,KV,S,hd], n[B]");
  }
  const Dims d{qd[0], qd[1], qd[2], qd[3], kd[2]};
  if (kd[0] != d.b || kd[1] != d.kv || kd[3] != d.hd || vd[0] != d.b || vd[1] != d.kv ||
      vd[2] != d.s || vd[3] != d.hd || nd[0] != d.b) {
    return ffi::Error::InvalidArgument("decode_attention: inconsistent shapes of q, k, v, n");
  }
  const PairFn pair = PairFor(d.g, d.hd);
  if (pair == nullptr) {
    return ffi::Error::InvalidArgument("decode_attention supports 1 to 8 query heads per kv head");
  }
  auto work = std::make_shared<Work>();
  work->q = q.typed_data();
  work->k = k.typed_data();
  work->v = v.typed_data();
  work->n = n.typed_data();
  work->out = out->typed_data();
  work->d = d;
  work->pair = pair;
  work->pairs = d.b * d.kv;
  if (work->pairs == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // A few chunks per thread balance ragged rows; small batches stay on the calling thread.
  work->chunk = std::max<int64_t>(1, work->pairs / (4 * threads));
  const int64_t helpers = std::min<int64_t>(threads, work->pairs / work->chunk) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { RunChunks(*work); });
  RunChunks(*work);
  // Every chunk is claimed; wait for those other threads are still computing.
  while (work->done.load() < work->pairs) std::this_thread::yield();
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------
// Weight-only int8 matmul for quantised decoding: y[M, O] = (x[M, I] . q[I, O]) * s[O].
//
// A decode step at small batch reads every weight once, so its time is the bytes of the weights:
// int8 reads a quarter of float32's. XLA:CPU converts an int8 matrix to float32 in memory before its
// dot (measured slower than the float32 dot), so the conversion happens here, in registers: each
// thread owns blocks of kCols output columns, widens one row of the block's weights at a time to
// float32 and accumulates it into kRows rows of outputs held in L1.

constexpr int64_t kCols = 128;
constexpr int64_t kRows = 32;

struct MatWork {
  const float* x;
  const int8_t* q;
  const float* s;
  float* y;
  int64_t m, in, out, blocks;
  std::atomic<int64_t> next{0}, done{0};
};

void MatBlock(const MatWork& w, int64_t block) {
  const int64_t o0 = block * kCols;
  const int64_t cols = std::min(kCols, w.out - o0);
  alignas(64) float wide[kCols];
  alignas(64) float acc[kRows][kCols];
  for (int64_t c = cols; c < kCols; ++c) wide[c] = 0.0f;
  for (int64_t m0 = 0; m0 < w.m; m0 += kRows) {
    const int64_t rows = std::min(kRows, w.m - m0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < kCols; ++c) acc[r][c] = 0.0f;
    }
    for (int64_t k = 0; k < w.in; ++k) {
      const int8_t* row = w.q + k * w.out + o0;
      for (int64_t c = 0; c < cols; ++c) wide[c] = static_cast<float>(row[c]);
      for (int64_t r = 0; r < rows; ++r) {
        const float xv = w.x[(m0 + r) * w.in + k];
        float* a = acc[r];
        for (int64_t c = 0; c < kCols; ++c) a[c] += xv * wide[c];
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* y = w.y + (m0 + r) * w.out + o0;
      for (int64_t c = 0; c < cols; ++c) y[c] = acc[r][c] * w.s[o0 + c];
    }
  }
}

void RunBlocks(MatWork& w) {
  for (;;) {
    const int64_t b = w.next.fetch_add(1);
    if (b >= w.blocks) return;
    MatBlock(w, b);
    w.done.fetch_add(1);
  }
}

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                          ffi::Buffer<ffi::F32> s, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = s.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 1 || xd[1] != qd[0] || sd[0] != qd[1]) {
    return ffi::Error::InvalidArgument("int8_matmul expects x[M, I], q[I, O] int8, s[O]");
  }
  auto work = std::make_shared<MatWork>();
  work->x = x.typed_data();
  work->q = q.typed_data();
  work->s = s.typed_data();
  work->y = y->typed_data();
  work->m = xd[0];
  work->in = xd[1];
  work->out = qd[1];
  work->blocks = (work->out + kCols - 1) / kCols;
  if (work->m == 0 || work->blocks == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min<int64_t>(threads, work->blocks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { RunBlocks(*work); });
  RunBlocks(*work);
  while (work->done.load() < work->blocks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LhInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LhDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
