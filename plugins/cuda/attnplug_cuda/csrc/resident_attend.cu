// attnplug CUDA plugin: small-step attention over a window that one CTA holds in registers
// (semantics: staged_attend.h; the launch: attnplug_staged_attend_launch with `resident`).
//
// No torch headers here: `nvcc -arch=sm_90 -c resident_attend.cu` compiles it alone.
//
// One CTA (8 warps) a (request, kv head) group, no split, no merge. The group's cached keys
// (positions before the step's first token, at most kCapacity: 256 at head dim 128, 512 at
// 64) are loaded from the paged cache straight into the registers that the tensor-core
// products take as operands, before cudaGridDependencySynchronize (no kernel of the previous
// launch writes them):
//
//   warp w holds the keys kv_lo + kKeysPerWarp w + [0, kKeysPerWarp), as n8 tiles;
//   K      for S = Q K^T the head dim is summed over, so it is taken in a permuted order in
//          which lane (gq, tq) holds dims [D/4 tq, D/4 tq + D/4) of key 8 t + gq of tile t:
//          16-byte loads, used as they land as the MMA's B operand (q is loaded in the same
//          order);
//   V      the output dims are permuted the same way (n8 tile n, column j: dim D/8 j + n), so
//          lane (gq, tq) holds dims [D/8 gq, D/8 gq + D/8) of the four keys its P fragment
//          covers in each 16-key step; byte permutes pair them into B operands. P stays in
//          the score accumulators (no shared memory on the way).
//
// After the wait a CTA loads q and the step's own K/V rows (from k / v when the kernel stores
// them): into the registers after the cached keys when they fit there, else into shared
// memory for warp 7. Every warp folds its keys (scores, masks, its own softmax, P V); where
// the own keys did not fit, warp 7 then folds them as one more 16-key step. The step's rows
// are stored at loc last. The warps' (max, sum, acc) meet once in shared memory, laid out so
// that every 16-byte store and load is free of bank conflicts, and each thread writes 8
// output dims of one row.
//
// The chain of dependent launches then holds, per layer: the wait, one round trip for q and
// the own rows, 64 tensor-core products a warp at head dim 128 (32 for the scores, 32 for
// P V), one barrier and the output write: no key in shared memory, no workspace, no ticket.
// Before the wait each CTA spends two dependent round trips (the step's metadata, then the
// table) before its keys' loads are issued; docs/benchmarks.md has what that costs.

#include <cstdint>

#include "attend_share.cuh"
#include "attention_device.cuh"
#include "staged_attend.h"

namespace {

using namespace attnplug_dev;  // NOLINT: the kernel's device helpers

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kOwnKeys = 16;           // the step's own keys: at most kRows (q_len <= 16)
constexpr float kMinLogit = -1.0e30f;  // start of a running max: exp2 of it is 0, never NaN
constexpr float kLog2e = 1.4426950408889634f;

template <int D>
struct Resident {
  static constexpr int kTiles = D == 128 ? 4 : 8;    // n8 key tiles a warp holds
  static constexpr int kKeysPerWarp = 8 * kTiles;    // 32 / 64
  static constexpr int kCapacity = kWarps * kKeysPerWarp;  // 256 / 512 cached keys a CTA
  static constexpr int kSteps = kTiles / 2;          // 16-key P V steps a warp runs
  static constexpr int kKVec = D / 32;               // 16-byte vectors of a key's K a lane holds (D/4 dims)
  static constexpr int kVVec = D / 64;               // 16-byte vectors of a key's V a lane holds (D/8 dims)
  static constexpr int kKSteps = D / 16;             // k16 steps of Q K^T
  static constexpr int kNTiles = D / 8;              // n8 output tiles of P V
  static constexpr int kOwnStride = D + 8;           // elements of an own row in shared memory
  static constexpr int kAccStride = D / 4 + 4;       // floats of a (row, tq) slice of the warps' acc
};

// Shared memory: the own rows (K, V), then each warp's (m, l) per row and acc per (row, tq).
template <int D>
constexpr size_t smem_bytes() {
  using R = Resident<D>;
  return 2 * static_cast<size_t>(kOwnKeys) * R::kOwnStride * 2 + 2 * kWarps * kRows * sizeof(float) +
         static_cast<size_t>(kWarps) * kRows * 4 * R::kAccStride * sizeof(float);
}

// 2^x by the special-function unit (ex2.approx.ftz: -inf gives 0)
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// S = Q K^T over the head dim for N n8 key tiles (fp32 accumulators c[t]), the tiles'
// products interleaved; qa the A operand per k16 step, kv[t] tile t's K vectors of this lane
// (their words 2 ks and 2 ks + 1 are step ks's B operand).
template <typename T, int D, int N>
__device__ __forceinline__ void score_tiles(float (*c)[4], const uint32_t (*qa)[4], const uint4 (*kv)[D / 32]) {
#pragma unroll
  for (int t = 0; t < N; ++t) {
    c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.0f;
  }
#pragma unroll
  for (int ks = 0; ks < Resident<D>::kKSteps; ++ks) {
#pragma unroll
    for (int t = 0; t < N; ++t) {
      mma<T>(c[t], qa[ks], word(kv[t][ks / 2], (ks % 2) * 2), word(kv[t][ks / 2], (ks % 2) * 2 + 1));
    }
  }
}

// acc += P V for one 16-key step: pa the P fragment, v[c] the V vectors of this lane's keys
// (c: 2 tq, 2 tq + 1 of the first tile, then of the second), output tile n of dims D/8 j + n.
template <typename T, int D>
__device__ __forceinline__ void pv_step(float (*acc)[4], const uint32_t* pa, const uint4 (*v)[Resident<D>::kVVec]) {
#pragma unroll
  for (int n = 0; n < Resident<D>::kNTiles; ++n) {
    const int w = (n / 2) % 4, vec = n / 8;
    const uint32_t sel = n % 2 == 0 ? 0x5410u : 0x7632u;
    const uint32_t b0 = __byte_perm(word(v[0][vec], w), word(v[1][vec], w), sel);
    const uint32_t b1 = __byte_perm(word(v[2][vec], w), word(v[3][vec], w), sel);
    mma<T>(acc[n], pa, b0, b1);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) resident_attend_kernel(const AttnplugStagedAttendArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using R = Resident<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* own_k = reinterpret_cast<T*>(smem_raw);
  T* own_v = own_k + kOwnKeys * R::kOwnStride;
  float* red_m = reinterpret_cast<float*>(own_v + kOwnKeys * R::kOwnStride);  // [kWarps][kRows]
  float* red_l = red_m + kWarps * kRows;
  float* red_acc = red_l + kWarps * kRows;  // [kWarps][kRows][4 (tq)][kAccStride]

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int gq = lane / 4;
  const int tq = lane % 4;
  const int g = blockIdx.y;
  const int b = g / a.num_kv_heads;
  const int hk = g % a.num_kv_heads;
  const bool use_pdl = a.pdl;
  stamp(a, 0);

#if __CUDA_ARCH__ >= 900
  if (use_pdl && !a.prologue) {
    cudaGridDependencySynchronize();
  }
#endif
  const Share s = share_of(a, b, 0);
  const int64_t kv_stride = static_cast<int64_t>(a.num_kv_heads) * D;
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);
  const int base = s.s_lo + warp * R::kKeysPerWarp;  // this warp's first key position
  // the cached keys: K of key 8 t + gq, V of keys 16 st + 8 h + 2 tq + e; positions at or past
  // the step's first token, or without a slot, hold zeros and are masked
  uint4 kr[R::kTiles][R::kKVec];
  uint4 vr[R::kSteps][4][R::kVVec];
  bool keep[R::kSteps][4];
#pragma unroll
  for (int t = 0; t < R::kTiles; ++t) {
    const int j = base + 8 * t + gq;
    const int64_t slot = j < s.new0 ? slot_of(a, s, j) : 0;
    const T* src = kc + slot * kv_stride + hk * D + (D / 4) * tq;
#pragma unroll
    for (int i = 0; i < R::kKVec; ++i) {
      kr[t][i] = slot != 0 ? __ldcg(reinterpret_cast<const uint4*>(src) + i) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
#pragma unroll
  for (int st = 0; st < R::kSteps; ++st) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = base + 16 * st + 8 * (c / 2) + 2 * tq + c % 2;
      const int64_t slot = j < s.new0 ? slot_of(a, s, j) : 0;
      keep[st][c] = slot != 0;
      const T* src = vc + slot * kv_stride + hk * D + (D / 8) * gq;
#pragma unroll
      for (int i = 0; i < R::kVVec; ++i) {
        vr[st][c][i] = slot != 0 ? __ldcg(reinterpret_cast<const uint4*>(src) + i) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
  stamp(a, 1);
#if __CUDA_ARCH__ >= 900
  if (use_pdl && a.prologue) {
    cudaGridDependencySynchronize();
  }
  if (use_pdl && a.release_early) {
    cudaTriggerProgrammaticLaunchCompletion();
  }
#endif
  stamp(a, 2);

  // the step's own keys: in the registers after the cached ones when they fit (a decode step
  // at a full window: 255 + 1), else warp 7 folds them as one more 16-key step, from shared
  // memory (zeros where a row holds no key)
  constexpr int kChunks = D / 8;
  const bool store = a.loc != nullptr;
  const bool own_in_regs = s.new0 + s.q_len - s.s_lo <= R::kCapacity;
  const T* kn = static_cast<const T*>(a.k_new);
  const T* vn = static_cast<const T*>(a.v_new);
  if (own_in_regs) {
#pragma unroll
    for (int t = 0; t < R::kTiles; ++t) {
      const int j = base + 8 * t + gq;
      if (j >= s.new0 && j < s.new0 + s.q_len) {
        const int64_t slot = slot_of(a, s, j);
        const T* src = store ? kn + (s.q_start + j - s.new0) * a.stride_knt : kc + slot * kv_stride;
#pragma unroll
        for (int i = 0; i < R::kKVec; ++i) {
          kr[t][i] = slot != 0 ? *(reinterpret_cast<const uint4*>(src + hk * D + (D / 4) * tq) + i)
                               : make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
#pragma unroll
    for (int st = 0; st < R::kSteps; ++st) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = base + 16 * st + 8 * (c / 2) + 2 * tq + c % 2;
        if (j >= s.new0 && j < s.new0 + s.q_len) {
          const int64_t slot = slot_of(a, s, j);
          keep[st][c] = slot != 0;
          const T* src = store ? vn + (s.q_start + j - s.new0) * a.stride_vnt : vc + slot * kv_stride;
#pragma unroll
          for (int i = 0; i < R::kVVec; ++i) {
            vr[st][c][i] = slot != 0 ? *(reinterpret_cast<const uint4*>(src + hk * D + (D / 8) * gq) + i)
                                     : make_uint4(0u, 0u, 0u, 0u);
          }
        }
      }
    }
  } else if (warp == kWarps - 1) {
    for (int idx = lane; idx < kOwnKeys * kChunks; idx += 32) {
      const int t = idx / kChunks, ch = idx % kChunks;
      const int64_t slot = t < s.q_len ? slot_of(a, s, s.new0 + t) : 0;
      const int64_t hc = static_cast<int64_t>(hk) * D + ch * 8;
      const int64_t row = s.q_start + t;
      const T* ksrc = slot == 0 ? kc : (store ? kn + row * a.stride_knt + hc : kc + slot * kv_stride + hc);
      const T* vsrc = slot == 0 ? vc : (store ? vn + row * a.stride_vnt + hc : vc + slot * kv_stride + hc);
      copy16(own_k + t * R::kOwnStride + ch * 8, ksrc, slot != 0 ? 16 : 0);
      copy16(own_v + t * R::kOwnStride + ch * 8, vsrc, slot != 0 ? 16 : 0);
    }
  }

  // q in the permuted head-dim order: rows gq and gq + 8, dims D/4 tq + 4 ks + {0, 1} (MMA
  // k 2 tq, 2 tq + 1) and + {2, 3} (k 2 tq + 8, + 9); rows past n_rows are zero
  uint32_t qa[R::kKSteps][4];
  int pos[2], lo_row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = gq + 8 * h;
    const int tok = r / a.group;
    const bool real = r < s.n_rows;
    pos[h] = s.new0 + tok;
    lo_row[h] = a.window > 0 ? max(pos[h] - a.window + 1, 0) : 0;
    const int head = hk * a.group + r % a.group;
    const uint4* qp = reinterpret_cast<const uint4*>(static_cast<const T*>(a.q) + (s.q_start + tok) * a.stride_qt +
                                                     head * a.stride_qh + (D / 4) * tq);
#pragma unroll
    for (int i = 0; i < R::kKVec; ++i) {
      const uint4 x = real ? qp[i] : make_uint4(0u, 0u, 0u, 0u);
      qa[2 * i][h] = x.x;
      qa[2 * i][2 + h] = x.y;
      qa[2 * i + 1][h] = x.z;
      qa[2 * i + 1][2 + h] = x.w;
    }
  }

  // the store: thread `tid` reads 16 bytes of the group's head of the step's K and V rows
  // now and writes them at loc once its keys are folded
  static_assert(kOwnKeys * (D / 8) <= kThreads, "one thread per 16 bytes of the step's rows");
  const int st_t = tid / kChunks;
  const int64_t st_hc = static_cast<int64_t>(hk) * D + (tid % kChunks) * 8;
  int64_t st_loc = 0;
  uint4 st_k, st_v;
  if (store && st_t < s.q_len) {
    const int64_t row = s.q_start + st_t;
    st_loc = load_index(a.loc, row, a.loc_is_int64);
    st_k = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.k_new) + row * a.stride_knt + st_hc);
    st_v = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.v_new) + row * a.stride_vnt + st_hc);
  }

  // scores of the cached keys, masked: column 2 tq + e of tile t is key base + 8 t + 2 tq + e
  float sc[R::kTiles][4];
  float m_run[2] = {kMinLogit, kMinLogit};
  score_tiles<T, D, R::kTiles>(sc, qa, kr);
#pragma unroll
  for (int t = 0; t < R::kTiles; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1;
      const int j = base + 8 * t + 2 * tq + (e & 1);
      float x = sc[t][e] * a.qk_scale;
      if (a.softcap_log2 != 0.0f) {
        x = tanhf(x) * a.softcap_log2;
      }
      x = keep[t / 2][2 * (t % 2) + (e & 1)] && j >= lo_row[r] && j <= pos[r] ? x : -INFINITY;
      sc[t][e] = x;
      m_run[r] = fmaxf(m_run[r], x);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m_run[r] = fmaxf(m_run[r], __shfl_xor_sync(0xffffffffu, m_run[r], 1));
    m_run[r] = fmaxf(m_run[r], __shfl_xor_sync(0xffffffffu, m_run[r], 2));
  }
  float l_run[2] = {0.0f, 0.0f};
  float acc[R::kNTiles][4];
#pragma unroll
  for (int n = 0; n < R::kNTiles; ++n) {
    acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  }
#pragma unroll
  for (int st = 0; st < R::kSteps; ++st) {
    uint32_t pa[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // tiles 2 st (h 0) and 2 st + 1
      const float* c = sc[2 * st + h];
      const float p0 = ex2(c[0] - m_run[0]), p1 = ex2(c[1] - m_run[0]);
      const float p2 = ex2(c[2] - m_run[1]), p3 = ex2(c[3] - m_run[1]);
      l_run[0] += p0 + p1;
      l_run[1] += p2 + p3;
      pa[2 * h] = pack<T>(p0, p1);
      pa[2 * h + 1] = pack<T>(p2, p3);
    }
    pv_step<T, D>(acc, pa, vr[st]);
  }

  // warp 7: the step's own keys, one more 16-key step (keys new0 + 8 h + column)
  if (!own_in_regs && warp == kWarps - 1) {
    copies_done();
    __syncwarp();
    float so[2][4];
    uint4 ko[2][R::kKVec];
    float m_own[2] = {m_run[0], m_run[1]};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < R::kKVec; ++i) {
        ko[h][i] = *reinterpret_cast<const uint4*>(own_k + (8 * h + gq) * R::kOwnStride + (D / 4) * tq + 8 * i);
      }
    }
    score_tiles<T, D, 2>(so, qa, ko);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const int t = 8 * h + 2 * tq + (e & 1);
        const int j = s.new0 + t;
        float x = so[h][e] * a.qk_scale;
        if (a.softcap_log2 != 0.0f) {
          x = tanhf(x) * a.softcap_log2;
        }
        const bool ok = t < s.q_len && slot_of(a, s, j) != 0 && j <= pos[r] && j >= lo_row[r];
        so[h][e] = ok ? x : -INFINITY;
        m_own[r] = fmaxf(m_own[r], so[h][e]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m_own[r] = fmaxf(m_own[r], __shfl_xor_sync(0xffffffffu, m_own[r], 1));
      m_own[r] = fmaxf(m_own[r], __shfl_xor_sync(0xffffffffu, m_own[r], 2));
      const float alpha = ex2(m_run[r] - m_own[r]);
      l_run[r] *= alpha;
#pragma unroll
      for (int n = 0; n < R::kNTiles; ++n) {
        acc[n][2 * r] *= alpha;
        acc[n][2 * r + 1] *= alpha;
      }
      m_run[r] = m_own[r];
    }
    uint32_t pa[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float p0 = ex2(so[h][0] - m_run[0]), p1 = ex2(so[h][1] - m_run[0]);
      const float p2 = ex2(so[h][2] - m_run[1]), p3 = ex2(so[h][3] - m_run[1]);
      l_run[0] += p0 + p1;
      l_run[1] += p2 + p3;
      pa[2 * h] = pack<T>(p0, p1);
      pa[2 * h + 1] = pack<T>(p2, p3);
    }
    uint4 vo[4][R::kVVec];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
      for (int i = 0; i < R::kVVec; ++i) {
        vo[c][i] = *reinterpret_cast<const uint4*>(own_v + (8 * (c / 2) + 2 * tq + c % 2) * R::kOwnStride +
                                                   (D / 8) * gq + 8 * i);
      }
    }
    pv_step<T, D>(acc, pa, vo);
  }
  if (st_loc >= 1 && st_loc < a.num_slots) {
    *reinterpret_cast<uint4*>(static_cast<T*>(a.k_cache) + st_loc * kv_stride + st_hc) = st_k;
    *reinterpret_cast<uint4*>(static_cast<T*>(a.v_cache) + st_loc * kv_stride + st_hc) = st_v;
  }
  stamp(a, 3);

  // the warps meet: (m, l) per row, acc per (row, tq) slice as this lane's D/4 dims
  // [D/4 tq, D/4 tq + D/4): tile n's column 2 tq holds dim D/4 tq + n, column 2 tq + 1 dim
  // D/4 tq + D/8 + n
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    const int row = gq + 8 * r;
    if (row < s.n_rows) {
      if (tq == 0) {
        red_m[warp * kRows + row] = m_run[r];
        red_l[warp * kRows + row] = l_run[r];
      }
      float* dst = red_acc + ((warp * kRows + row) * 4 + tq) * R::kAccStride;
#pragma unroll
      for (int e = 0; e < D / 4; e += 4) {
        float4 x;
        const int half = e / (D / 8), n = e % (D / 8);
        x.x = acc[n][2 * r + half];
        x.y = acc[n + 1][2 * r + half];
        x.z = acc[n + 2][2 * r + half];
        x.w = acc[n + 3][2 * r + half];
        *reinterpret_cast<float4*>(dst + e) = x;
      }
    }
  }
  __syncthreads();

  // thread `tid`: 8 dims of one row (16 bytes of out)
  static_assert(kRows * (D / 8) <= kThreads, "one thread per 8 output dims");
  const int row = tid / (D / 8);
  const int d0 = (tid % (D / 8)) * 8;
  if (row < s.n_rows) {
    float m_all = kMinLogit;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      m_all = fmaxf(m_all, red_m[w * kRows + row]);
    }
    float total = 0.0f, o[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      o[e] = 0.0f;
    }
    const int slice = d0 / (D / 4), off = d0 % (D / 4);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = ex2(red_m[w * kRows + row] - m_all);
      total += f * red_l[w * kRows + row];
      const float* src = red_acc + ((w * kRows + row) * 4 + slice) * R::kAccStride + off;
      const float4 x0 = *reinterpret_cast<const float4*>(src);
      const float4 x1 = *reinterpret_cast<const float4*>(src + 4);
      o[0] += f * x0.x;
      o[1] += f * x0.y;
      o[2] += f * x0.z;
      o[3] += f * x0.w;
      o[4] += f * x1.x;
      o[5] += f * x1.y;
      o[6] += f * x1.z;
      o[7] += f * x1.w;
    }
    const int head = hk * a.group + row % a.group;
    float scale = 1.0f;
    if (a.sinks != nullptr) {  // joins the denominator only
      const float sink = a.sinks[head] * kLog2e;
      const float m_fin = fmaxf(m_all, sink);
      scale = ex2(m_all - m_fin);
      total = total * scale + ex2(sink - m_fin);
    }
    const float inv = scale / (total > 0.0f ? total : 1.0f);
    uint4 out;
    out.x = pack<T>(o[0] * inv, o[1] * inv);
    out.y = pack<T>(o[2] * inv, o[3] * inv);
    out.z = pack<T>(o[4] * inv, o[5] * inv);
    out.w = pack<T>(o[6] * inv, o[7] * inv);
    *reinterpret_cast<uint4*>(static_cast<T*>(a.out) + (s.q_start + row / a.group) * a.stride_ot +
                              head * a.stride_oh + d0) = out;
  }
  stamp(a, 4);
#if __CUDA_ARCH__ >= 900
  if (use_pdl && !a.release_early) {
    cudaTriggerProgrammaticLaunchCompletion();
  }
#endif
#endif  // __CUDA_ARCH__ >= 800
}

template <typename T, int D>
cudaError_t launch_typed(const AttnplugStagedAttendArgs& a, cudaStream_t stream, bool* pdl_used) {
  static LaunchState state;  // per kernel instantiation
  const dim3 grid(1, static_cast<unsigned int>(a.num_reqs * a.num_kv_heads), 1);
  return launch_attend(resident_attend_kernel<T, D>, &state, grid, kThreads, smem_bytes<D>(), a, stream, pdl_used);
}

}  // namespace

extern "C" int attnplug_resident_attend_capacity(int head_dim) {
  return head_dim == 128 ? Resident<128>::kCapacity : (head_dim == 64 ? Resident<64>::kCapacity : 0);
}

extern "C" cudaError_t attnplug_resident_attend_launch(const AttnplugStagedAttendArgs* a, cudaStream_t stream,
                                                       bool* pdl_used) {
  if (a->dtype == STAGED_ATTEND_FLOAT16) {
    return a->head_dim == 64 ? launch_typed<__half, 64>(*a, stream, pdl_used)
                             : launch_typed<__half, 128>(*a, stream, pdl_used);
  }
  return a->head_dim == 64 ? launch_typed<__nv_bfloat16, 64>(*a, stream, pdl_used)
                           : launch_typed<__nv_bfloat16, 128>(*a, stream, pdl_used);
}
