// How fast can a few SMs gather a window of paged KV rows into shared memory?
//
// A small-batch attention layer whose CTAs cover few SMs waits on each CTA's copies: at
// batch 1 an SWA layer (window 256, D 128, bf16) needs 256 K rows and 256 V rows of 256 bytes,
// 128 KB, in each of 8 CTAs. This program times that gather in isolation, per CTA from its
// start to the last row in shared memory (%globaltimer), for five ways of copying:
//
//   cp_async     16-byte cp.async.cg by 256 threads (the staged_attend kernel's way)
//   ldg          16-byte ld.global.nc into registers (32 loads in flight a thread), then st.shared
//   ldcg         the same with ld.global.cg (cached in L2 only; coherent with writes of the kernel)
//   bulk_all     cp.async.bulk (the copy engine) of each 256-byte row, issued by all 256 threads,
//                completed on one mbarrier
//   bulk_warp    the same copies issued by one warp
//
// for rows at random slots or contiguous slots, a cold L2 (a 256 MB sweep before each launch)
// or a warm one (the same rows read by the launch before), and 1, 8, 32 or 132 CTAs (one an
// SM). Each row of the table is the median over repeats of the slowest CTA's gather time and
// the rate of one CTA (bytes / that time).
//
//   nvcc -O3 -arch=sm_90a -std=c++17 -o sm_copy_rate sm_copy_rate.cu && ./sm_copy_rate
//
// Prints one table row per case; checks every staged byte against the source.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CHECK(x)                                                                    \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

constexpr int kThreads = 256;
constexpr int kKeys = 256;         // rows of K and of V a CTA gathers
constexpr int kD = 128;            // elements of a row (bf16: 256 bytes)
constexpr int kRowBytes = kD * 2;
constexpr int kStrideBytes = kRowBytes + 16;  // padded staged row (ldmatrix without conflicts)
constexpr int kHeads = 8;          // kv heads of a slot: a row is one head's slice of the slot
constexpr int kSmem = 2 * kKeys * kStrideBytes;

enum Mode { kCpAsync = 0, kLdg = 1, kLdcg = 2, kBulkAll = 3, kBulkWarp = 4 };
constexpr int kModes = 5;
const char* kModeNames[] = {"cp_async", "ldg", "ldcg", "bulk_all", "bulk_warp"};

__device__ __forceinline__ uint64_t now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t saddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// CTA c gathers head (c % kHeads) of the slots slots[c * kKeys ...] of k and v into shared
// memory, then (to keep the copies live) writes the staged bytes to out[c]; t[c] = ns taken.
template <int M>
__global__ void __launch_bounds__(kThreads, 1)
    gather(const uint4* __restrict__ k, const uint4* __restrict__ v, const int32_t* __restrict__ slots,
           uint4* __restrict__ out, int64_t* __restrict__ t) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bar;
  const uint64_t t0 = now();
  const int c = blockIdx.x;
  const int head = c % kHeads;
  const int tid = threadIdx.x;
  const int32_t* my = slots + static_cast<int64_t>(c) * kKeys;
  constexpr int kChunks = kRowBytes / 16;  // 16-byte chunks of a row
  unsigned char* ks = smem;
  unsigned char* vs = smem + kKeys * kStrideBytes;
  if constexpr (M == kCpAsync) {
    const int chunk = tid % kChunks;
#pragma unroll 4
    for (int kk = tid / kChunks; kk < kKeys; kk += kThreads / kChunks) {
      const int64_t row = (static_cast<int64_t>(my[kk]) * kHeads + head) * kChunks + chunk;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr(ks + kk * kStrideBytes + chunk * 16)),
                   "l"(k + row)
                   : "memory");
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr(vs + kk * kStrideBytes + chunk * 16)),
                   "l"(v + row)
                   : "memory");
    }
    asm volatile("cp.async.commit_group;\ncp.async.wait_all;\n" ::: "memory");
    __syncthreads();
  } else if constexpr (M == kLdg || M == kLdcg) {
    constexpr int kPer = kKeys / (kThreads / kChunks);  // rows of K a thread touches: 16
    const int chunk = tid % kChunks;
    uint4 rk[kPer], rv[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int kk = tid / kChunks + i * (kThreads / kChunks);
      const int64_t row = (static_cast<int64_t>(my[kk]) * kHeads + head) * kChunks + chunk;
      rk[i] = M == kLdg ? __ldg(k + row) : __ldcg(k + row);
      rv[i] = M == kLdg ? __ldg(v + row) : __ldcg(v + row);
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int kk = tid / kChunks + i * (kThreads / kChunks);
      *reinterpret_cast<uint4*>(ks + kk * kStrideBytes + chunk * 16) = rk[i];
      *reinterpret_cast<uint4*>(vs + kk * kStrideBytes + chunk * 16) = rv[i];
    }
    __syncthreads();
  } else {
    if (tid == 0) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(saddr(&bar)) : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int issuers = M == kBulkAll ? kThreads : 32;
    if (tid < issuers) {
      for (int kk = tid; kk < kKeys; kk += issuers) {
        const int64_t row = (static_cast<int64_t>(my[kk]) * kHeads + head) * kChunks;
        asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(saddr(&bar)),
                     "r"(2 * kRowBytes)
                     : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                saddr(ks + kk * kStrideBytes)),
            "l"(k + row), "r"(kRowBytes), "r"(saddr(&bar))
            : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                saddr(vs + kk * kStrideBytes)),
            "l"(v + row), "r"(kRowBytes), "r"(saddr(&bar))
            : "memory");
      }
    }
    __syncthreads();
    if (tid == 0) {
      asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(saddr(&bar)) : "memory");
    }
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(saddr(&bar))
          : "memory");
    }
    __syncthreads();
  }
  const uint64_t t1 = now();
  if (tid == 0) {
    t[c] = static_cast<int64_t>(t1 - t0);
  }
  // write the staged rows out, unpadded: [c][K rows | V rows][kChunks]
  uint4* o = out + static_cast<int64_t>(c) * 2 * kKeys * kChunks;
  for (int i = tid; i < 2 * kKeys * kChunks; i += kThreads) {
    const int kk = i / kChunks, ch = i % kChunks;
    const unsigned char* src = kk < kKeys ? ks + kk * kStrideBytes : vs + (kk - kKeys) * kStrideBytes;
    o[i] = *reinterpret_cast<const uint4*>(src + ch * 16);
  }
}

__global__ void sweep(uint4* p, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint4 x = p[i];
    x.x += 1;
    p[i] = x;
  }
}

using Kernel = void (*)(const uint4*, const uint4*, const int32_t*, uint4*, int64_t*);

int main() {
  const int64_t n_slots = 1 << 16;  // 65536 slots x 8 heads x 256 B = 128 MB each of K and V
  const int64_t row_vecs = kRowBytes / 16;
  const int64_t n_vec = n_slots * kHeads * row_vecs;
  const int max_ctas = 132;
  uint4 *k, *v, *out, *flush;
  int32_t* slots;
  int64_t* t;
  const int64_t flush_vec = (256ll << 20) / 16;
  CHECK(cudaMalloc(&k, n_vec * 16));
  CHECK(cudaMalloc(&v, n_vec * 16));
  CHECK(cudaMalloc(&out, static_cast<int64_t>(max_ctas) * 2 * kKeys * row_vecs * 16));
  CHECK(cudaMalloc(&flush, flush_vec * 16));
  CHECK(cudaMalloc(&slots, static_cast<int64_t>(max_ctas) * kKeys * 4));
  CHECK(cudaMalloc(&t, max_ctas * 8));
  {
    std::vector<uint32_t> h(n_vec * 4);
    for (int64_t i = 0; i < static_cast<int64_t>(h.size()); ++i) h[i] = static_cast<uint32_t>(i * 2654435761u);
    CHECK(cudaMemcpy(k, h.data(), n_vec * 16, cudaMemcpyHostToDevice));
    for (auto& x : h) x ^= 0x5a5a5a5au;
    CHECK(cudaMemcpy(v, h.data(), n_vec * 16, cudaMemcpyHostToDevice));
  }
  Kernel kernels[] = {gather<kCpAsync>, gather<kLdg>, gather<kLdcg>, gather<kBulkAll>, gather<kBulkWarp>};
  for (Kernel kern : kernels) CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  std::mt19937 rng(7);
  std::printf("%-10s %-10s %-5s %5s %12s %12s %14s\n", "mode", "slots", "L2", "ctas", "gather_us", "gather_p10", "GB/s_per_cta");
  bool ok = true;
  for (int contiguous = 0; contiguous < 2; ++contiguous) {
    // slots of CTA c: a permutation prefix (random) or a run starting at a random slot
    std::vector<int32_t> hs(static_cast<size_t>(max_ctas) * kKeys);
    std::vector<int32_t> perm(n_slots - 1);
    for (int64_t i = 0; i < n_slots - 1; ++i) perm[i] = static_cast<int32_t>(i + 1);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int c = 0; c < max_ctas; ++c) {
      const int32_t base = 1 + static_cast<int32_t>(rng() % (n_slots - kKeys - 1));
      for (int j = 0; j < kKeys; ++j) hs[c * kKeys + j] = contiguous ? base + j : perm[(c * kKeys + j) % perm.size()];
    }
    CHECK(cudaMemcpy(slots, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
    for (int warm = 0; warm < 2; ++warm) {
      for (int ctas : {1, 8, 32, 132}) {
        for (int m = 0; m < kModes; ++m) {
          std::vector<double> slowest;
          for (int rep = 0; rep < 25; ++rep) {
            if (warm) {
              kernels[m]<<<ctas, kThreads, kSmem>>>(k, v, slots, out, t);
            } else {
              sweep<<<264, 512>>>(flush, flush_vec);
            }
            kernels[m]<<<ctas, kThreads, kSmem>>>(k, v, slots, out, t);
            CHECK(cudaGetLastError());
            CHECK(cudaDeviceSynchronize());
            std::vector<int64_t> ht(ctas);
            CHECK(cudaMemcpy(ht.data(), t, ctas * 8, cudaMemcpyDeviceToHost));
            slowest.push_back(static_cast<double>(*std::max_element(ht.begin(), ht.end())) / 1e3);
          }
          std::sort(slowest.begin(), slowest.end());
          const double med = slowest[slowest.size() / 2], p10 = slowest[slowest.size() / 10];
          std::printf("%-10s %-10s %-5s %5d %12.3f %12.3f %14.1f\n", kModeNames[m], contiguous ? "contiguous" : "random",
                      warm ? "warm" : "cold", ctas, med, p10, 2.0 * kKeys * kRowBytes / (med * 1e3));
          // check what CTA 0 and the last CTA staged
          for (int c : {0, ctas - 1}) {
            std::vector<uint4> ho(2 * kKeys * row_vecs), hk(row_vecs), hv(row_vecs);
            CHECK(cudaMemcpy(ho.data(), out + static_cast<int64_t>(c) * 2 * kKeys * row_vecs, ho.size() * 16,
                             cudaMemcpyDeviceToHost));
            for (int j = 0; j < kKeys; j += 37) {
              const int64_t row = (static_cast<int64_t>(hs[c * kKeys + j]) * kHeads + c % kHeads) * row_vecs;
              CHECK(cudaMemcpy(hk.data(), k + row, row_vecs * 16, cudaMemcpyDeviceToHost));
              CHECK(cudaMemcpy(hv.data(), v + row, row_vecs * 16, cudaMemcpyDeviceToHost));
              for (int e = 0; e < row_vecs; ++e) {
                const uint4 a = ho[j * row_vecs + e], b = hk[e], cc = ho[(kKeys + j) * row_vecs + e], d = hv[e];
                if (a.x != b.x || a.y != b.y || a.z != b.z || a.w != b.w || cc.x != d.x || cc.w != d.w) ok = false;
              }
            }
          }
        }
      }
    }
  }
  std::printf("staged bytes %s\n", ok ? "match the source" : "DIFFER from the source");
  return ok ? 0 : 1;
}
