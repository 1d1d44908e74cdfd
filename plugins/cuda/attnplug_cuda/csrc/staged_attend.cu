// attnplug CUDA plugin: small-step attention, each CTA's keys staged in shared memory before
// the PDL wait (semantics and work split: staged_attend.h).
//
// No torch headers here: `nvcc -arch=sm_90 -c staged_attend.cu` compiles it alone.
//
// A CTA (8 warps) runs its share of a group's keys in passes of at most `capacity` keys:
//
//   stage    the pass's table entries, then cp.async copies of its K and V rows into shared
//            memory (16 bytes a copy; positions without a key zero-filled). In the first pass
//            the cached rows of positions before the step's own tokens are copied before
//            cudaGridDependencySynchronize (no kernel of the previous launch writes them), the
//            step's own rows after it (from k / v when the kernel stores them);
//   scores   S = Q K^T on the tensor cores (mma.sync m16n8k16, fp32 accumulate): the group's
//            rows (at most 16: (token, q head) pairs) against the pass's 16-key tiles, dealt
//            round-robin to the warps; scale, softcap, key / causal / window masks;
//   softmax  the rows' maxima meet in shared memory (one barrier); P = exp2(S - m), rounded
//            to the input dtype as the Triton kernels do, goes to shared memory over the dead
//            K tile, with the warps' row sums (second barrier);
//   P V      each warp owns D / 8 output columns over all the pass's keys: P by ldmatrix, V
//            transposed by ldmatrix, so no warp's accumulators need merging with another's.
//
// The rows' running (max, sum) and the accumulators carry across passes (online softmax). A
// group of one split writes its output straight from the accumulators; with several splits
// each CTA writes (m, l, acc / l) to the workspace, takes the group's ticket, and the last
// CTA merges the splits in split order (so the result never depends on which CTA merges) and
// returns the ticket to zero for the next launch.
//
// PDL (sm_90+): with `prologue`, the step's metadata, the first pass's table entries and the
// copies of its cached rows are issued before cudaGridDependencySynchronize; q, the step's
// own K/V, the store and every later pass come after it. The dependents are released right
// after the wait (`release_early`) or after the last store. The CUDA runtime intrinsics are
// used, never hand-written PDL assembly (it lacks the memory clobber).

#include "staged_attend.h"

#include <cstdint>

#include "attend_share.cuh"
#include "attention_device.cuh"

namespace {

using namespace attnplug_dev;  // NOLINT: the kernel's device helpers

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTileKeys = 16;       // keys of one score tile
constexpr int kCapacityStep = kWarps * kTileKeys;  // 128: capacities are multiples of this
constexpr int kMergeLoads = 8;      // splits whose partials the merge loads at once
constexpr float kMinLogit = -1.0e30f;  // start of a running max: exp2 of it is 0, never NaN
constexpr float kLog2e = 1.4426950408889634f;

// Most keys one pass stages: K and V rows (padded by 16 bytes) within the 227 KB a CTA may
// use, in whole multiples of 128 keys.
template <int D>
struct Limits {
  static constexpr int kStride = D + 8;  // elements of a staged row
  static constexpr int kMaxCapacity = D == 128 ? 384 : 512;
  static constexpr int kTilesPerWarp = kMaxCapacity / kCapacityStep;  // score tiles a warp holds
  static constexpr int kColsPerWarp = D / kWarps;  // output columns of a warp in P V
  static constexpr int kNTilesPerWarp = kColsPerWarp / 8;
};

size_t smem_bytes(int capacity, int head_dim) {
  const size_t rows = 2 * static_cast<size_t>(capacity) * (head_dim + 8) * 2;  // K and V, 16-bit
  return rows + 2 * kWarps * kRows * sizeof(float) + static_cast<size_t>(capacity) * sizeof(int32_t);
}

// Shared memory of a CTA (dynamic): K and V rows of a pass, the P tile over the K rows once
// the scores are taken, the warps' row maxima and sums, and the slot of every staged
// position (0: no key).
template <typename T, int D>
struct Smem {
  T* k;
  T* v;
  T* p;  // [kRows][capacity + 8], aliases k
  float* red_m;  // [kWarps][kRows]
  float* red_l;
  int32_t* slot;  // [capacity]
  int p_stride;

  __device__ Smem(unsigned char* raw, int capacity) {
    constexpr int S = Limits<D>::kStride;
    k = reinterpret_cast<T*>(raw);
    v = k + static_cast<size_t>(capacity) * S;
    p = k;
    red_m = reinterpret_cast<float*>(v + static_cast<size_t>(capacity) * S);
    red_l = red_m + kWarps * kRows;
    slot = reinterpret_cast<int32_t*>(red_l + kWarps * kRows);
    p_stride = capacity + 8;
  }
};

// The table entries of positions [lo, lo + n) into shared memory: one global round trip,
// then a barrier.
__device__ __forceinline__ void read_slots(const AttnplugStagedAttendArgs& a, const Share& s, int lo, int n,
                                           int32_t* slot) {
  for (int kk = threadIdx.x; kk < n; kk += kThreads) {
    slot[kk] = static_cast<int32_t>(slot_of(a, s, lo + kk));
  }
  __syncthreads();
}

// Stage the positions [lo, lo + n) of a pass (n a multiple of 16; their slots read): thread
// `tid` copies 16-byte chunk `tid % (D / 8)` of every (kThreads / (D / 8))-th position.
// With `cached`, the cached rows of positions before the step's tokens and the zero-fills of
// positions without a key; with `own`, the rows of the step's own tokens (from k / v when the
// kernel stores them, else from the cache).
template <typename T, int D>
__device__ __forceinline__ void stage(const AttnplugStagedAttendArgs& a, const Share& s, int hk, int lo, int n,
                                      bool cached, bool own, const Smem<T, D>& sm) {
  constexpr int kChunks = D / 8;
  constexpr int kPerSweep = kThreads / kChunks;
  constexpr int S = Limits<D>::kStride;
  const int tid = threadIdx.x;
  const int64_t kv_stride = static_cast<int64_t>(a.num_kv_heads) * D;
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);
  if (cached) {
    const int chunk = tid % kChunks;
    const int64_t col = static_cast<int64_t>(hk) * D + chunk * 8;
#pragma unroll 4
    for (int kk = tid / kChunks; kk < n; kk += kPerSweep) {
      const int64_t slot = sm.slot[kk];
      if (slot == 0 || lo + kk < s.new0) {
        const int64_t off = slot * kv_stride + col;
        const int bytes = slot != 0 ? 16 : 0;
        copy16(sm.k + kk * S + chunk * 8, kc + off, bytes);
        copy16(sm.v + kk * S + chunk * 8, vc + off, bytes);
      }
    }
  }
  if (own) {
    const bool store = a.loc != nullptr;
    const T* kn = static_cast<const T*>(a.k_new);
    const T* vn = static_cast<const T*>(a.v_new);
    for (int idx = tid; idx < s.q_len * kChunks; idx += kThreads) {
      const int t = idx / kChunks;
      const int kk = s.new0 + t - lo;
      if (kk < 0 || kk >= n) {
        continue;
      }
      const int64_t slot = sm.slot[kk];
      if (slot == 0) {
        continue;  // zero-filled with the cached rows
      }
      const int64_t hc = static_cast<int64_t>(hk) * D + (idx % kChunks) * 8;
      const int64_t row = s.q_start + t;
      const T* ksrc = store ? kn + row * a.stride_knt + hc : kc + slot * kv_stride + hc;
      const T* vsrc = store ? vn + row * a.stride_vnt + hc : vc + slot * kv_stride + hc;
      copy16(sm.k + kk * S + (idx % kChunks) * 8, ksrc, 16);
      copy16(sm.v + kk * S + (idx % kChunks) * 8, vsrc, 16);
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) staged_attend_kernel(const AttnplugStagedAttendArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using L = Limits<D>;
  constexpr int S = L::kStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ int merging;
  const Smem<T, D> sm(smem_raw, a.capacity);

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int gq = lane / 4;  // the thread's rows in MMA fragments: gq and gq + 8
  const int tq = lane % 4;
  const int split = blockIdx.x;
  const int g = blockIdx.y;  // (request, kv head) group
  const int b = g / a.num_kv_heads;
  const int hk = g % a.num_kv_heads;
  const bool use_pdl = a.pdl;
  stamp(a, 0);

#if __CUDA_ARCH__ >= 900
  if (use_pdl && !a.prologue) {
    cudaGridDependencySynchronize();
  }
#endif
  const Share s = share_of(a, b, split);
  const int first_n = min(a.capacity, (s.s_hi - s.s_lo + kTileKeys - 1) / kTileKeys * kTileKeys);
  // the first pass's cached rows: before the wait with the prologue (written before this step)
  read_slots(a, s, s.s_lo, first_n, sm.slot);
  stage<T, D>(a, s, hk, s.s_lo, first_n, /*cached=*/true, /*own=*/false, sm);
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

  // q as the A operand: rows gq (registers 0, 2) and gq + 8 (1, 3), head-dim pairs 16 ks +
  // 2 tq (0, 1) and + 8 (2, 3); rows past n_rows are zero
  constexpr int kKSteps = D / 16;
  uint32_t qa[kKSteps][4];
  int pos[2], lo_row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = gq + 8 * h;
    const int tok = r / a.group;
    const bool real = r < s.n_rows;
    pos[h] = s.new0 + tok;
    lo_row[h] = a.window > 0 ? max(pos[h] - a.window + 1, 0) : 0;
    const int head = hk * a.group + r % a.group;
    const T* qp = static_cast<const T*>(a.q) + (s.q_start + tok) * a.stride_qt + head * a.stride_qh + 2 * tq;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      qa[ks][h] = real ? *reinterpret_cast<const uint32_t*>(qp + 16 * ks) : 0u;
      qa[ks][2 + h] = real ? *reinterpret_cast<const uint32_t*>(qp + 16 * ks + 8) : 0u;
    }
  }

  // the store: one CTA per group writes the group's head of the step's K/V rows
  if (a.loc != nullptr && split == 0) {
    constexpr int kChunks = D / 8;
    const int64_t kv_stride = static_cast<int64_t>(a.num_kv_heads) * D;
    for (int idx = tid; idx < s.q_len * kChunks; idx += kThreads) {
      const int t = idx / kChunks;
      const int64_t row = s.q_start + t;
      const int64_t loc = load_index(a.loc, row, a.loc_is_int64);
      if (loc >= 1 && loc < a.num_slots) {
        const int64_t hc = static_cast<int64_t>(hk) * D + (idx % kChunks) * 8;
        *reinterpret_cast<uint4*>(static_cast<T*>(a.k_cache) + loc * kv_stride + hc) =
            *reinterpret_cast<const uint4*>(static_cast<const T*>(a.k_new) + row * a.stride_knt + hc);
        *reinterpret_cast<uint4*>(static_cast<T*>(a.v_cache) + loc * kv_stride + hc) =
            *reinterpret_cast<const uint4*>(static_cast<const T*>(a.v_new) + row * a.stride_vnt + hc);
      }
    }
  }

  float m_run[2] = {kMinLogit, kMinLogit};  // rows gq, gq + 8: every thread holds the same
  float l_run[2] = {0.0f, 0.0f};
  float acc[L::kNTilesPerWarp][4];
#pragma unroll
  for (int n = 0; n < L::kNTilesPerWarp; ++n) {
    acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  }

  for (int lo = s.s_lo; lo < s.s_hi; lo += a.capacity) {
    const int n = min(a.capacity, (s.s_hi - lo + kTileKeys - 1) / kTileKeys * kTileKeys);
    if (lo != s.s_lo) {
      __syncthreads();  // every warp is done with the last pass's tiles
      read_slots(a, s, lo, n, sm.slot);
      stage<T, D>(a, s, hk, lo, n, /*cached=*/true, /*own=*/true, sm);
    } else {
      stage<T, D>(a, s, hk, lo, n, /*cached=*/false, /*own=*/true, sm);
    }
    copies_done();
    __syncthreads();
    if (lo == s.s_lo) {
      stamp(a, 6);
    }
    const int n_tiles = n / kTileKeys;

    // scores: tile i goes to warp i % kWarps; two n8 halves of 8 keys each
    float sc[L::kTilesPerWarp][2][4];
    float mx[2] = {kMinLogit, kMinLogit};
#pragma unroll
    for (int u = 0; u < L::kTilesPerWarp; ++u) {
      const int tile = warp + kWarps * u;
      if (tile >= n_tiles) {
        break;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sc[u][h][0] = sc[u][h][1] = sc[u][h][2] = sc[u][h][3] = 0.0f;
      }
      const int mat = lane / 8;
      const T* krow = sm.k + (tile * kTileKeys + (mat / 2) * 8 + lane % 8) * S + (mat % 2) * 8;
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        uint32_t kb[4];
        ldmatrix_x4<false>(krow + 16 * ks, kb);
        mma<T>(sc[u][0], qa[ks], kb[0], kb[1]);
        mma<T>(sc[u][1], qa[ks], kb[2], kb[3]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kl = tile * kTileKeys + 8 * h + 2 * tq + (e & 1);
          const int j = lo + kl;
          const int r = e >> 1;  // 0: row gq, 1: row gq + 8
          float x = sc[u][h][e] * a.qk_scale;
          if (a.softcap_log2 != 0.0f) {
            x = tanhf(x) * a.softcap_log2;
          }
          const bool keep = sm.slot[kl] != 0 && j <= pos[r] && j >= lo_row[r];
          sc[u][h][e] = keep ? x : -INFINITY;
          mx[r] = fmaxf(mx[r], sc[u][h][e]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    if (tq == 0) {
      sm.red_m[warp * kRows + gq] = mx[0];
      sm.red_m[warp * kRows + gq + 8] = mx[1];
    }
    __syncthreads();  // the maxima are in; every warp is done with the K tile
    float alpha[2], m_new[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float m = m_run[r];
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        m = fmaxf(m, sm.red_m[w * kRows + gq + 8 * r]);
      }
      m_new[r] = m;
      alpha[r] = exp2f(m_run[r] - m);
      m_run[r] = m;
    }
#pragma unroll
    for (int u = 0; u < L::kTilesPerWarp; ++u) {
      const int tile = warp + kWarps * u;
      if (tile >= n_tiles) {
        break;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int kl = tile * kTileKeys + 8 * h + 2 * tq;
        const float p0 = exp2f(sc[u][h][0] - m_new[0]);
        const float p1 = exp2f(sc[u][h][1] - m_new[0]);
        const float p2 = exp2f(sc[u][h][2] - m_new[1]);
        const float p3 = exp2f(sc[u][h][3] - m_new[1]);
        sum[0] += p0 + p1;
        sum[1] += p2 + p3;
        *reinterpret_cast<uint32_t*>(sm.p + gq * sm.p_stride + kl) = pack<T>(p0, p1);
        *reinterpret_cast<uint32_t*>(sm.p + (gq + 8) * sm.p_stride + kl) = pack<T>(p2, p3);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
    }
    if (tq == 0) {
      sm.red_l[warp * kRows + gq] = sum[0];
      sm.red_l[warp * kRows + gq + 8] = sum[1];
    }
    __syncthreads();  // P and the sums are in
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        l += sm.red_l[w * kRows + gq + 8 * r];
      }
      l_run[r] = l_run[r] * alpha[r] + l;
    }
#pragma unroll
    for (int nt = 0; nt < L::kNTilesPerWarp; ++nt) {
      acc[nt][0] *= alpha[0];
      acc[nt][1] *= alpha[0];
      acc[nt][2] *= alpha[1];
      acc[nt][3] *= alpha[1];
    }
    // P V over this warp's columns: P rows by ldmatrix as A, V transposed as B
    const int col0 = warp * L::kColsPerWarp;
    const int mat = lane / 8;
    const T* prow = sm.p + ((mat % 2) * 8 + lane % 8) * sm.p_stride + (mat / 2) * 8;
    for (int ks = 0; ks < n_tiles; ++ks) {
      uint32_t pa[4];
      ldmatrix_x4<false>(prow + 16 * ks, pa);
      if constexpr (L::kNTilesPerWarp == 2) {
        uint32_t vb[4];
        ldmatrix_x4_trans(sm.v + (16 * ks + (mat % 2) * 8 + lane % 8) * S + col0 + (mat / 2) * 8, vb);
        mma<T>(acc[0], pa, vb[0], vb[1]);
        mma<T>(acc[1], pa, vb[2], vb[3]);
      } else {
        uint32_t vb[2];
        ldmatrix_x2_trans(sm.v + (16 * ks + (mat % 2) * 8 + lane % 8) * S + col0, vb);
        mma<T>(acc[0], pa, vb[0], vb[1]);
      }
    }
  }

  stamp(a, 3);
  T* out = static_cast<T*>(a.out);
  const int col0 = warp * L::kColsPerWarp;
  if (a.splits == 1) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = gq + 8 * r;
      if (row >= s.n_rows) {
        continue;
      }
      const int head = hk * a.group + row % a.group;
      float l = l_run[r];
      float scale = 1.0f;
      if (a.sinks != nullptr) {  // joins the denominator only
        const float sink = a.sinks[head] * kLog2e;
        const float m_fin = fmaxf(m_run[r], sink);
        scale = exp2f(m_run[r] - m_fin);
        l = l * scale + exp2f(sink - m_fin);
      }
      const float inv = scale / (l > 0.0f ? l : 1.0f);
      T* orow = out + (s.q_start + row / a.group) * a.stride_ot + head * a.stride_oh + col0 + 2 * tq;
#pragma unroll
      for (int nt = 0; nt < L::kNTilesPerWarp; ++nt) {
        *reinterpret_cast<uint32_t*>(orow + 8 * nt) = pack<T>(acc[nt][2 * r] * inv, acc[nt][2 * r + 1] * inv);
      }
    }
    stamp(a, 4);
  } else {
    // workspace: m [groups, splits, 16], then l (same), then acc / l [groups, splits, 16, D]
    // in the input dtype
    const int64_t n_ml = static_cast<int64_t>(gridDim.y) * a.splits * kRows;
    float* ws_m = a.workspace;
    float* ws_l = a.workspace + n_ml;
    T* ws_acc = reinterpret_cast<T*>(a.workspace + 2 * n_ml);
    const int64_t base = static_cast<int64_t>(g) * a.splits * kRows;
    const int64_t mine = base + static_cast<int64_t>(split) * kRows;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = gq + 8 * r;
      if (warp == 0 && tq == 0) {
        ws_m[mine + row] = m_run[r];
        ws_l[mine + row] = l_run[r];
      }
      const float inv = 1.0f / (l_run[r] > 0.0f ? l_run[r] : 1.0f);
      T* wrow = ws_acc + (mine + row) * D + col0 + 2 * tq;
#pragma unroll
      for (int nt = 0; nt < L::kNTilesPerWarp; ++nt) {
        *reinterpret_cast<uint32_t*>(wrow + 8 * nt) = pack<T>(acc[nt][2 * r] * inv, acc[nt][2 * r + 1] * inv);
      }
    }
    __threadfence();  // this thread's partial is visible device-wide before the ticket
    __syncthreads();
    if (tid == 0) {
      merging = atomicAdd(a.tickets + g, 1) == a.splits - 1;
    }
    __syncthreads();
    stamp(a, 4);
    if (merging) {  // the last CTA of the group: every split's partial, in split order
      __threadfence();
      // thread `tid` merges 8 consecutive output columns of one row (16-byte loads of the
      // partials); kMergeLoads splits' partials are loaded before any is folded, so their loads
      // are in flight together: one L2 round trip a trip, whatever the rows and columns
      constexpr int kVecs = D / 8;  // 16-byte vectors of a row
      static_assert(kRows * kVecs <= kThreads, "one thread per 16-byte output vector");
      const int row = tid / kVecs;
      const int c0 = (tid % kVecs) * 8;
      if (row < s.n_rows) {
        float m_all = kMinLogit, total = 0.0f, merged[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          merged[e] = 0.0f;
        }
        for (int q0 = 0; q0 < a.splits; q0 += kMergeLoads) {
          float m_q[kMergeLoads], l_q[kMergeLoads];
          uint4 v_q[kMergeLoads];
#pragma unroll
          for (int i = 0; i < kMergeLoads; ++i) {
            m_q[i] = kMinLogit;
            l_q[i] = 0.0f;
            v_q[i] = make_uint4(0u, 0u, 0u, 0u);
            if (q0 + i < a.splits) {
              const int64_t at = base + static_cast<int64_t>(q0 + i) * kRows + row;
              m_q[i] = __ldcg(ws_m + at);
              l_q[i] = __ldcg(ws_l + at);
              v_q[i] = __ldcg(reinterpret_cast<const uint4*>(ws_acc + at * D + c0));
            }
          }
#pragma unroll
          for (int i = 0; i < kMergeLoads; ++i) {
            const float m_new = fmaxf(m_all, m_q[i]);
            const float al = exp2f(m_all - m_new);
            const float w = exp2f(m_q[i] - m_new) * l_q[i];
            const T* part = reinterpret_cast<const T*>(&v_q[i]);
            total = total * al + w;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              merged[e] = merged[e] * al + w * Elem<T>::to_float(part[e]);
            }
            m_all = m_new;
          }
        }
        const int head = hk * a.group + row % a.group;
        float scale = 1.0f;
        if (a.sinks != nullptr) {  // joins the denominator only
          const float sink = a.sinks[head] * kLog2e;
          const float m_fin = fmaxf(m_all, sink);
          scale = exp2f(m_all - m_fin);
          total = total * scale + exp2f(sink - m_fin);
        }
        const float inv = scale / (total > 0.0f ? total : 1.0f);
        uint4 o;
        uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          ow[e] = pack<T>(merged[2 * e] * inv, merged[2 * e + 1] * inv);
        }
        *reinterpret_cast<uint4*>(out + (s.q_start + row / a.group) * a.stride_ot + head * a.stride_oh + c0) = o;
      }
      if (tid == 0) {
        a.tickets[g] = 0;  // ready for the next launch
      }
      stamp(a, 5);
    }
  }
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
  const dim3 grid(static_cast<unsigned int>(a.splits), static_cast<unsigned int>(a.num_reqs * a.num_kv_heads), 1);
  return launch_attend(staged_attend_kernel<T, D>, &state, grid, kThreads, smem_bytes(a.capacity, D), a, stream,
                       pdl_used);
}

template <typename T>
cudaError_t launch_by_dim(const AttnplugStagedAttendArgs& a, cudaStream_t stream, bool* pdl_used) {
  return a.head_dim == 64 ? launch_typed<T, 64>(a, stream, pdl_used) : launch_typed<T, 128>(a, stream, pdl_used);
}

}  // namespace

extern "C" int attnplug_staged_attend_max_capacity(int head_dim) {
  return head_dim == 128 ? Limits<128>::kMaxCapacity : (head_dim == 64 ? Limits<64>::kMaxCapacity : 0);
}

extern "C" size_t attnplug_staged_attend_workspace_bytes(int programs, int head_dim) {
  const size_t rows = static_cast<size_t>(programs > 0 ? programs : 0) * kRows;
  return rows * 2 * sizeof(float) + rows * static_cast<size_t>(head_dim) * 2;
}

extern "C" const char* attnplug_staged_attend_unsupported(const AttnplugStagedAttendArgs* a, int max_q_len) {
  if (a == nullptr) return "no arguments";
  if (a->dtype != STAGED_ATTEND_FLOAT16 && a->dtype != STAGED_ATTEND_BFLOAT16) return "dtype is not float16 or bfloat16";
  const int cap = attnplug_staged_attend_max_capacity(a->head_dim);
  if (cap == 0) return "head_dim is not 64 or 128";
  if (a->group < 1 || a->num_kv_heads < 1 || a->num_reqs < 0) return "group, num_kv_heads or num_reqs out of range";
  if (max_q_len < 1 || static_cast<int64_t>(max_q_len) * a->group > kRows)
    return "max_q_len x group (rows of a group) is not in 1..16";
  if (a->splits < 1 || a->splits > 65535) return "splits is not in 1..65535";
  if (a->resident) {
    if (a->splits != 1) return "the resident kernel runs one CTA a group (splits 1)";
    if (a->capacity != attnplug_resident_attend_capacity(a->head_dim))
      return "the resident kernel's capacity is attnplug_resident_attend_capacity(head_dim)";
  } else if (a->capacity < kCapacityStep || a->capacity > cap || a->capacity % kCapacityStep != 0) {
    return "capacity is not a multiple of 128 within the head_dim's maximum";
  }
  if (a->window < 0) return "window is negative";
  if (a->q == nullptr || a->k_new == nullptr || a->v_new == nullptr || a->k_cache == nullptr || a->v_cache == nullptr ||
      a->out == nullptr || a->cu_q_lens == nullptr || a->seq_lens == nullptr || a->table == nullptr ||
      a->table_rows == nullptr)
    return "a required pointer is null";
  if (a->splits > 1 && (a->workspace == nullptr || a->tickets == nullptr)) return "splits > 1 needs workspace and tickets";
  const void* bases[6] = {a->q, a->k_new, a->v_new, a->k_cache, a->v_cache, a->out};
  for (const void* p : bases) {
    if (!aligned16(p)) return "a q / k / v / cache / out base address is not 16-byte aligned";
  }
  if (a->workspace != nullptr && !aligned16(a->workspace)) return "workspace is not 16-byte aligned";
  const int64_t strides[6] = {a->stride_qt, a->stride_qh, a->stride_knt, a->stride_vnt, a->stride_ot, a->stride_oh};
  for (const int64_t st : strides) {
    if (st % 8 != 0) return "a q / k / v / out stride is not a multiple of 8 elements (16 bytes)";
  }
  return nullptr;
}

extern "C" cudaError_t attnplug_staged_attend_launch(const AttnplugStagedAttendArgs* a, int max_q_len,
                                                     cudaStream_t stream, bool* pdl_used) {
  if (pdl_used != nullptr) {
    *pdl_used = false;
  }
  if (attnplug_staged_attend_unsupported(a, max_q_len) != nullptr) {
    return cudaErrorInvalidValue;
  }
  if (a->num_reqs == 0) {
    return cudaSuccess;
  }
  int device = 0, major = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e != cudaSuccess) return e;
  if (major < 8) return cudaErrorNotSupported;  // mma.sync bf16, cp.async
  if (a->resident) return attnplug_resident_attend_launch(a, stream, pdl_used);
  return a->dtype == STAGED_ATTEND_FLOAT16 ? launch_by_dim<__half>(*a, stream, pdl_used)
                                           : launch_by_dim<__nv_bfloat16>(*a, stream, pdl_used);
}
