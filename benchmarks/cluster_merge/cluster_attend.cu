// One-launch small-step attention, KV splits merged in a thread-block cluster
// (semantics, work split and the stamps: cluster_attend.h).
//
// No torch headers here: `nvcc -arch=sm_90 -I plugins/cuda/attnplug_cuda/csrc -c cluster_attend.cu`
// compiles it alone (the plugin's device helpers, attention_device.cuh, come from there).
//
// Inside a CTA (4 warps): a pass stages 64 keys' K and V rows in shared memory
// (cp.async, 16 bytes a copy, zero-filled where a position holds no key), then each
// warp folds 16 of them into its online-softmax state with tensor-core MMAs
// (mma.sync m16n8k16, fp32 accumulate): S = Q K^T with the group's rows (at most 8:
// the tile's first 8 rows; the other 8 are zero) against 8 keys a tile, then P V with
// the probabilities (rounded to the input dtype, as the Triton kernels do) taken
// straight from S's accumulator registers and V read transposed by ldmatrix. The CTA
// merges its warps through shared memory, then the cluster merges its CTAs through
// distributed shared memory.
//
// PDL: with `prologue`, the step's metadata, the first pass's table entries and the
// copies of the cached K/V of positions before the step's own tokens are issued before
// cudaGridDependencySynchronize (no kernel of the last launch writes them); q, the
// step's own K/V and the store come after it. The dependents are released right after
// the wait (`release_early`) or after the last store. The CUDA runtime intrinsics are
// used for PDL, never inline griddepcontrol assembly (it lacks the memory clobber).

#include "cluster_attend.h"

#include <cooperative_groups.h>

#include <cstdint>

// the plugin's device helpers (plugins/cuda/attnplug_cuda/csrc on the include path)
#include "attention_device.cuh"

namespace cg = cooperative_groups;

#ifdef CLUSTER_ATTEND_STAMPS
__device__ long long attnplug_cluster_stamps[CLUSTER_ATTEND_MAX_STAMPED_CTAS * CLUSTER_ATTEND_STAMPS_PER_CTA];
#define STAMP(i)                                                                                       \
  do {                                                                                                 \
    const unsigned cta = blockIdx.y * gridDim.x + blockIdx.x;                                          \
    if (threadIdx.x == 0 && cta < CLUSTER_ATTEND_MAX_STAMPED_CTAS)                                   \
      attnplug_cluster_stamps[cta * CLUSTER_ATTEND_STAMPS_PER_CTA + (i)] = clock64();                \
  } while (0)
#else
#define STAMP(i) \
  do {           \
  } while (0)
#endif

namespace {

using namespace attnplug_dev;  // NOLINT: the kernel's device helpers

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kWarpKeys = 16;                  // keys one warp folds per pass
constexpr int kPassKeys = kWarps * kWarpKeys;  // keys one pass stages
constexpr int kRows = 8;                       // rows of the tile that can be real
constexpr int kMaxSplits = 16;
constexpr float kMinLogit = -1.0e30f;  // start of a running max: exp2 of it is 0, never NaN
constexpr float kLog2e = 1.4426950408889634f;

// Shared memory of a CTA: a pass's K / V rows (padded by 16 bytes so that the rows of an
// 8-row access fall in distinct banks), or, after the last pass, the warps' partials; and
// the CTA's partial, which its cluster peers read.
template <typename T, int D>
struct Shared {
  static constexpr int kStride = D + 8;
  union {
    struct {
      T k[kPassKeys][kStride];
      T v[kPassKeys][kStride];
    } tile;
    struct {
      float m[kWarps][kRows];
      float l[kWarps][kRows];
      float acc[kWarps][kRows][D];
    } warp;
  } u;
  int has_key[kPassKeys];
  float cta_m[kRows];
  float cta_l[kRows];
  float cta_acc[kRows][D];
};

// The request-level facts every CTA of a group derives from the step's metadata.
struct Group {
  int64_t q_start;
  int q_len;
  int n_rows;
  int new0;        // position of the step's first token
  int s_lo, s_hi;  // this CTA's key range
  int t_start;
  const int32_t* t_row;
};

__device__ __forceinline__ Group group_of(const AttnplugClusterAttendArgs& a, int b, int split) {
  Group g;
  g.q_start = a.cu_q_lens[b];
  g.q_len = a.cu_q_lens[b + 1] - static_cast<int>(g.q_start);
  const int seq_len = static_cast<int>(load_index(a.seq_lens, b, a.seq_lens_is_int64));
  int64_t t_idx = load_index(a.table_rows, b, a.table_rows_is_int64);
  g.t_start = a.table_start != nullptr ? static_cast<int>(load_index(a.table_start, b, a.table_start_is_int64)) : 0;
  g.new0 = seq_len - g.q_len;
  g.n_rows = min(g.q_len * a.group, kRows);
  int kv_lo = 0;
  if (a.window > 0) {
    kv_lo = max(g.new0 - a.window + 1, 0);
  }
  int kv_hi = g.q_len > 0 ? seq_len : kv_lo;
  kv_hi = max(kv_hi, kv_lo);
  split_share(kv_lo, kv_hi, a.splits, split, &g.s_lo, &g.s_hi);
  if (t_idx < 0 || t_idx >= a.table_rows_len) {
    t_idx = 0;  // outside the table: row 0
  }
  g.t_row = a.table + t_idx * a.stride_table;
  return g;
}

// The slot of key position j, or 0 when j holds no key of this split.
__device__ __forceinline__ int64_t slot_of(const AttnplugClusterAttendArgs& a, const Group& g, int j) {
  const int col = j - g.t_start;
  if (j >= g.s_hi || col < 0 || col >= a.table_width) {
    return 0;
  }
  const int64_t slot = g.t_row[col];
  return (slot >= 1 && slot < a.num_slots) ? slot : 0;
}

// Staging of one pass: thread `tid` copies 16-byte chunk `tid % (D / 8)` of keys
// `tid / (D / 8) + i * (kThreads / (D / 8))`.
template <int D>
struct Stage {
  static constexpr int kChunks = D / 8;                  // 16-byte chunks of a row
  static constexpr int kKeysPerSweep = kThreads / kChunks;
  static constexpr int kKeys = kPassKeys / kKeysPerSweep;  // keys a thread copies
};

// One pass's table entries (into `slot`), then the copies of the cached rows of positions
// before the step's tokens and the zero-fills of positions without a key; the step's own
// rows are copied by the caller, after the PDL wait.
template <typename T, int D>
__device__ __forceinline__ void stage_cached(const AttnplugClusterAttendArgs& a, const Group& g, int base, int tid,
                                             int chunk, int64_t kv_stride, int64_t head_col, const T* kc, const T* vc,
                                             Shared<T, D>& sh, int64_t (&slot)[Stage<D>::kKeys]) {
  using St = Stage<D>;
#pragma unroll
  for (int i = 0; i < St::kKeys; ++i) {
    slot[i] = slot_of(a, g, base + tid / St::kChunks + i * St::kKeysPerSweep);
  }
#pragma unroll
  for (int i = 0; i < St::kKeys; ++i) {
    const int kk = tid / St::kChunks + i * St::kKeysPerSweep;
    const int j = base + kk;
    if (slot[i] == 0 || j < g.new0) {
      const int64_t off = slot[i] * kv_stride + head_col;
      const int bytes = slot[i] != 0 ? 16 : 0;
      copy16(&sh.u.tile.k[kk][chunk * 8], kc + off, bytes);
      copy16(&sh.u.tile.v[kk][chunk * 8], vc + off, bytes);
    }
    if (chunk == 0) {
      sh.has_key[kk] = slot[i] != 0;
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) cluster_attend_kernel(const AttnplugClusterAttendArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using St = Stage<D>;
  constexpr int kKSteps = D / 16;  // k16 steps of Q K^T
  constexpr int kNTiles = D / 8;   // n8 tiles of P V
  __shared__ __align__(16) Shared<T, D> sh;

  STAMP(0);
  const int split = static_cast<int>(blockIdx.x);
  const int pid_g = static_cast<int>(blockIdx.y);
  const int b = pid_g / a.num_kv_heads;
  const int hk = pid_g % a.num_kv_heads;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int gq = lane / 4;  // MMA group: the tile row (and key / head-dim column) a thread holds
  const int tq = lane % 4;  // thread in the group
  const int64_t kv_stride = static_cast<int64_t>(a.num_kv_heads) * D;
  const int chunk = tid % St::kChunks;
  const int64_t head_col = static_cast<int64_t>(hk) * D + chunk * 8;
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);
  const T* kn = static_cast<const T*>(a.k_new);
  const T* vn = static_cast<const T*>(a.v_new);
  const bool store = a.loc != nullptr;

  if (!a.prologue) {
    cudaGridDependencySynchronize();
  }
  const Group g = group_of(a, b, split);
  STAMP(1);

  // The first pass: table entries, then copies of the cached K/V of positions before the
  // step's tokens (positions without a key zero-filled).
  int64_t slot[St::kKeys];
  stage_cached<T, D>(a, g, g.s_lo, tid, chunk, kv_stride, head_col, kc, vc, sh, slot);

  STAMP(2);
  if (a.prologue) {
    cudaGridDependencySynchronize();
  }
  if (a.release_early) {
    cudaTriggerProgrammaticLaunchCompletion();
  }

  if (store && split == 0) {  // one CTA per group stores the group's head of the new rows
    for (int idx = tid; idx < g.q_len * St::kChunks; idx += kThreads) {
      const int t = idx / St::kChunks;
      const int c = idx % St::kChunks;
      const int64_t row = g.q_start + t;
      const int64_t loc = load_index(a.loc, row, a.loc_is_int64);
      if (loc >= 1 && loc < a.num_slots) {
        const int64_t src = static_cast<int64_t>(hk) * D + c * 8;
        const int64_t dst = loc * kv_stride + src;
        *reinterpret_cast<uint4*>(static_cast<T*>(a.k_cache) + dst) =
            *reinterpret_cast<const uint4*>(kn + row * a.stride_knt + src);
        *reinterpret_cast<uint4*>(static_cast<T*>(a.v_cache) + dst) =
            *reinterpret_cast<const uint4*>(vn + row * a.stride_vnt + src);
      }
    }
  }

  // q as the MMA's A operand: row gq of the tile, head-dim pairs (16 ks + 2 tq, + 1) and
  // (16 ks + 2 tq + 8, + 9); rows 8..15 and rows past n_rows are zero.
  const int tok = gq / a.group;
  const int pos = g.new0 + tok;
  const int lo = a.window > 0 ? max(pos - a.window + 1, 0) : 0;
  uint32_t qa[kKSteps][2];
  {
    const bool real = gq < g.n_rows;
    const int head = hk * a.group + gq % a.group;
    const T* qp = static_cast<const T*>(a.q) + (g.q_start + tok) * a.stride_qt + head * a.stride_qh + 2 * tq;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      qa[ks][0] = real ? *reinterpret_cast<const uint32_t*>(qp + 16 * ks) : 0u;
      qa[ks][1] = real ? *reinterpret_cast<const uint32_t*>(qp + 16 * ks + 8) : 0u;
    }
  }

  float m_run = kMinLogit, l_run = 0.0f;  // row gq; l_run: this thread's keys only
  float acc[kNTiles][4];
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) {
    acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  }

  for (int base = g.s_lo;;) {
    // the step's own keys of this pass (written by the previous kernels)
#pragma unroll
    for (int i = 0; i < St::kKeys; ++i) {
      const int kk = tid / St::kChunks + i * St::kKeysPerSweep;
      const int j = base + kk;
      if (slot[i] != 0 && j >= g.new0) {
        const T* ks = store ? kn + (g.q_start + (j - g.new0)) * a.stride_knt + head_col : kc + slot[i] * kv_stride + head_col;
        const T* vs = store ? vn + (g.q_start + (j - g.new0)) * a.stride_vnt + head_col : vc + slot[i] * kv_stride + head_col;
        copy16(&sh.u.tile.k[kk][chunk * 8], ks, 16);
        copy16(&sh.u.tile.v[kk][chunk * 8], vs, 16);
      }
    }
    copies_done();
    __syncthreads();
    STAMP(3);

    // S = Q K^T over this warp's 16 keys: two n8 tiles
    const int k0 = warp * kWarpKeys;
    float s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      const T* krow = &sh.u.tile.k[k0 + 8 * nt + gq][2 * tq];
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        const uint32_t aq[4] = {qa[ks][0], 0u, qa[ks][1], 0u};
        mma<T>(s[nt], aq, *reinterpret_cast<const uint32_t*>(krow + 16 * ks),
                     *reinterpret_cast<const uint32_t*>(krow + 16 * ks + 8));
      }
    }
    // logits of row gq, keys k0 + 8 nt + 2 tq + e: scale, cap, mask; the row's max over the
    // warp's keys (the four threads of the group)
    float mx = kMinLogit;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int kl = k0 + 8 * nt + 2 * tq + e;
        const int j = base + kl;
        float x = s[nt][e] * a.qk_scale;
        if (a.softcap_log2 != 0.0f) {
          x = tanhf(x) * a.softcap_log2;
        }
        const bool keep = sh.has_key[kl] && j <= pos && j >= lo;
        s[nt][e] = keep ? x : -INFINITY;
        mx = fmaxf(mx, s[nt][e]);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx);
    const float alpha = exp2f(m_run - m_new);
    m_run = m_new;
    float p[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      p[nt][0] = exp2f(s[nt][0] - m_new);
      p[nt][1] = exp2f(s[nt][1] - m_new);
    }
    l_run = l_run * alpha + (p[0][0] + p[0][1]) + (p[1][0] + p[1][1]);
    // P V: P from S's accumulators as the A operand (keys 2 tq, + 1 and 2 tq + 8, + 9), V
    // transposed by ldmatrix as B, two n8 tiles of head dims per load
    const uint32_t ap[4] = {pack<T>(p[0][0], p[0][1]), 0u, pack<T>(p[1][0], p[1][1]), 0u};
    const int mat = lane / 8;
    const T* vrow = &sh.u.tile.v[k0 + (mat % 2) * 8 + lane % 8][(mat / 2) * 8];
#pragma unroll
    for (int j16 = 0; j16 < D / 16; ++j16) {
      uint32_t bv[4];
      ldmatrix_x4_trans(vrow + 16 * j16, bv);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float* c = acc[2 * j16 + h];
        c[0] *= alpha;
        c[1] *= alpha;
        mma<T>(c, ap, bv[2 * h], bv[2 * h + 1]);
      }
    }

    base += kPassKeys;
    if (base >= g.s_hi) {
      break;
    }
    __syncthreads();  // every warp is done with the tile
    // the next pass: table entries, then copies of the cached rows
    stage_cached<T, D>(a, g, base, tid, chunk, kv_stride, head_col, kc, vc, sh, slot);
  }

  // the CTA's partial: its warps merged through shared memory
  STAMP(4);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  __syncthreads();  // the tile is dead: its memory takes the warps' partials
  if (tq == 0) {
    sh.u.warp.m[warp][gq] = m_run;
    sh.u.warp.l[warp][gq] = l_run;
  }
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) {
    sh.u.warp.acc[warp][gq][8 * n + 2 * tq] = acc[n][0];
    sh.u.warp.acc[warp][gq][8 * n + 2 * tq + 1] = acc[n][1];
  }
  __syncthreads();
  const int n_out = g.n_rows * D;
  for (int idx = tid; idx < n_out; idx += kThreads) {
    const int r = idx / D;
    const int d = idx % D;
    float mm = kMinLogit;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, sh.u.warp.m[w][r]);
    float ll = 0.0f, aa = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = exp2f(sh.u.warp.m[w][r] - mm);
      ll = fmaf(wt, sh.u.warp.l[w][r], ll);
      aa = fmaf(wt, sh.u.warp.acc[w][r][d], aa);
    }
    sh.cta_acc[r][d] = aa;
    if (d == 0) {
      sh.cta_m[r] = mm;
      sh.cta_l[r] = ll;
    }
  }

  // the group's output: every split's partial, merged in split order
  STAMP(5);
  T* out = static_cast<T*>(a.out);
  cg::cluster_group cluster = cg::this_cluster();
  if (a.splits > 1) {
    cluster.sync();  // release / acquire: every CTA's partial is visible to its peers
  } else {
    __syncthreads();
  }
  STAMP(6);
  for (int idx = split * kThreads + tid; idx < n_out; idx += a.splits * kThreads) {
    const int r = idx / D;
    const int d = idx % D;
    float m_all = kMinLogit, total = 0.0f, merged = 0.0f;
    float ms[kMaxSplits], ls[kMaxSplits], as[kMaxSplits];
#pragma unroll
    for (int q = 0; q < kMaxSplits; ++q) {
      if (q < a.splits) {
        const Shared<T, D>* peer = a.splits > 1 ? cluster.map_shared_rank(&sh, q) : &sh;
        ms[q] = peer->cta_m[r];
        ls[q] = peer->cta_l[r];
        as[q] = peer->cta_acc[r][d];
      }
    }
#pragma unroll
    for (int q = 0; q < kMaxSplits; ++q) {
      if (q < a.splits) {
        const float m_new = fmaxf(m_all, ms[q]);
        const float al = exp2f(m_all - m_new);
        const float w = exp2f(ms[q] - m_new);
        total = total * al + w * ls[q];
        merged = merged * al + w * as[q];
        m_all = m_new;
      }
    }
    const int head = hk * a.group + r % a.group;
    if (a.sinks != nullptr) {  // joins the denominator only
      const float sink = a.sinks[head] * kLog2e;
      const float m_fin = fmaxf(m_all, sink);
      const float al = exp2f(m_all - m_fin);
      total = total * al + exp2f(sink - m_fin);
      merged *= al;
    }
    const float o = merged / (total > 0.0f ? total : 1.0f);
    out[(g.q_start + r / a.group) * a.stride_ot + head * a.stride_oh + d] = Elem<T>::from_float(o);
  }
  STAMP(7);
  if (a.splits > 1) {
    cluster.sync();  // no CTA leaves while a peer may still read its shared memory
  }
  STAMP(8);
  if (!a.release_early) {
    cudaTriggerProgrammaticLaunchCompletion();
  }
#endif  // __CUDA_ARCH__ >= 900
}

template <typename T, int D>
cudaError_t launch_typed(const AttnplugClusterAttendArgs& a, cudaStream_t stream) {
  auto kernel = cluster_attend_kernel<T, D>;
  if (a.splits > 8) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess) {
      return e;
    }
  }
  cudaLaunchAttribute attrs[2];
  int n = 0;
  if (a.splits > 1) {  // one CTA a group: a plain launch
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = static_cast<unsigned int>(a.splits);
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  if (a.pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned int>(a.splits), static_cast<unsigned int>(a.num_reqs * a.num_kv_heads), 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, a);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the non-sticky launch error
  }
  return err;
}

template <typename T>
cudaError_t launch_by_dim(const AttnplugClusterAttendArgs& a, cudaStream_t stream) {
  return a.head_dim == 64 ? launch_typed<T, 64>(a, stream) : launch_typed<T, 128>(a, stream);
}

}  // namespace

extern "C" const char* attnplug_cluster_attend_unsupported(const AttnplugClusterAttendArgs* a) {
  if (a == nullptr) return "no arguments";
  if (a->dtype != CLUSTER_ATTEND_FLOAT16 && a->dtype != CLUSTER_ATTEND_BFLOAT16) return "dtype is not float16 or bfloat16";
  if (a->head_dim != 64 && a->head_dim != 128) return "head_dim is not 64 or 128";
  if (a->rows < 1 || a->rows > kRows) return "rows (new tokens x group) is not in 1..8";
  if (a->group < 1 || a->num_kv_heads < 1 || a->num_reqs < 0) return "group, num_kv_heads or num_reqs out of range";
  if (a->splits < 1 || a->splits > kMaxSplits || (a->splits & (a->splits - 1)) != 0) return "splits is not a power of two in 1..16";
  if (a->q == nullptr || a->k_new == nullptr || a->v_new == nullptr || a->k_cache == nullptr || a->v_cache == nullptr ||
      a->out == nullptr || a->cu_q_lens == nullptr || a->seq_lens == nullptr || a->table == nullptr ||
      a->table_rows == nullptr)
    return "a required pointer is null";
  const void* bases[5] = {a->q, a->k_new, a->v_new, a->k_cache, a->v_cache};
  for (const void* p : bases) {
    if (!aligned16(p)) return "a q / k / v / cache base address is not 16-byte aligned";
  }
  const int64_t strides[4] = {a->stride_qt, a->stride_qh, a->stride_knt, a->stride_vnt};
  for (const int64_t s : strides) {
    if (s % 8 != 0) return "a q / k / v row stride is not a multiple of 8 elements (16 bytes)";
  }
  return nullptr;
}

extern "C" cudaError_t attnplug_cluster_attend_launch(const AttnplugClusterAttendArgs* a, cudaStream_t stream,
                                                      bool* pdl_used) {
  if (pdl_used != nullptr) {
    *pdl_used = false;
  }
  if (attnplug_cluster_attend_unsupported(a) != nullptr) {
    return cudaErrorInvalidValue;
  }
  if (a->num_reqs == 0) {
    return cudaSuccess;
  }
  int device = 0, major = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e != cudaSuccess) return e;
  if (major < 9) return cudaErrorNotSupported;  // thread-block clusters
  const cudaError_t err = a->dtype == CLUSTER_ATTEND_FLOAT16 ? launch_by_dim<__half>(*a, stream)
                                                            : launch_by_dim<__nv_bfloat16>(*a, stream);
  if (err == cudaSuccess && pdl_used != nullptr) {
    *pdl_used = a->pdl;
  }
  return err;
}

#ifdef CLUSTER_ATTEND_STAMPS
extern "C" cudaError_t attnplug_cluster_attend_read_stamps(long long* host, int n) {
  const int most = CLUSTER_ATTEND_MAX_STAMPED_CTAS * CLUSTER_ATTEND_STAMPS_PER_CTA;
  return cudaMemcpyFromSymbol(host, attnplug_cluster_stamps, static_cast<size_t>(n < most ? n : most) * sizeof(long long));
}
#endif

// The launch probe: a kernel that does almost nothing, launched as a grid of groups x
// splits CTAs of 128 threads, with or without a cluster of `splits` CTAs and the two
// cluster barriers of cluster_attend_kernel, with or without PDL: what a cluster costs a
// launch.
__global__ void cluster_launch_probe_kernel(float* out, int cluster_barriers) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ float x[32];
  cudaGridDependencySynchronize();
  cudaTriggerProgrammaticLaunchCompletion();
  x[threadIdx.x % 32] = static_cast<float>(threadIdx.x);
  if (cluster_barriers) cg::this_cluster().sync();
  if (threadIdx.x == 0 && blockIdx.x == 0) out[blockIdx.y] = x[1];
  if (cluster_barriers) cg::this_cluster().sync();
#endif
}

extern "C" cudaError_t attnplug_cluster_launch_probe(float* out, int groups, int splits, bool cluster, bool pdl,
                                                     cudaStream_t stream) {
  if (splits > 8) {
    const cudaError_t e =
        cudaFuncSetAttribute(cluster_launch_probe_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess) return e;
  }
  cudaLaunchAttribute attrs[2];
  int n = 0;
  if (cluster) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = static_cast<unsigned int>(splits);
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned int>(splits), static_cast<unsigned int>(groups), 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, cluster_launch_probe_kernel, out, cluster ? 1 : 0);
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}
