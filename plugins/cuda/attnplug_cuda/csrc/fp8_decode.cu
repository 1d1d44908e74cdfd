// attnplug CUDA plugin: decode attention over an FP8 (e4m3 / e5m2) paged KV cache, with PDL.
//
// No torch headers here (fp8_decode.h says what it computes); CI compiles this file alone with
//     nvcc -arch=sm_90 -c fp8_decode.cu
//
// Work split: one CTA = one request x one kv head, 4 warps. Warp w takes the 16-key tiles w, w + 4,
// w + 8, ... of the request's key range and keeps its own running max, sum and accumulator; the
// warps merge through shared memory at the end. Each warp streams its tiles through its own ring
// of STAGES tiles in shared memory (cp.async, two tiles in flight while one is read), so a CTA has
// no barrier in its key loop and the SM as many loads in flight as four CTAs' rings.
//
// The products are mma.sync m16n8k16 (float16 in, float32 accumulators) with the KEYS as M, so a
// tile's 8 columns of N are the group's q heads (8 at most; heads >= G are zero columns):
//   S^T = K q^T     A = K [16 keys x 16 d] a k-step, B = q^T [16 d x 8 heads], 8 k-steps;
//   O^T += V^T P^T  A = V^T [16 d x 16 keys] an m-tile, B = P^T [16 keys x 8 heads], 8 m-tiles.
// Fragments (g = lane / 4, t = lane % 4):
//  * The head dim is permuted the same way for K and q (a dot product does not see the order):
//    k index 2t + j of k-step s is byte 32t + 4s + j of the row, 2t + 8 + j is byte
//    32t + 4s + 2 + j. A thread's A fragments of keys g and g + 8 are then the 32 contiguous bytes
//    [32t, 32t + 32) of their rows (two 16-byte chunks each), a 4-byte word a k-step; bytes 0, 1
//    of the word are a0 (a1 for key g + 8), bytes 2, 3 are a2 (a3), converted by
//    cvt.rn.f16x2.e4m3x2 (e5m2x2) a pair.
//  * P^T's B fragments are S^T's C fragments (key g, heads 2t, 2t + 1) transposed by movmatrix.
//  * V^T's rows are permuted: row g of m-tile j is d = 16g + 2j, row g + 8 is 16g + 2j + 1, so a
//    thread's 16 d's are the contiguous bytes [16g, 16g + 16) of the rows of keys 2t, 2t + 1,
//    2t + 8, 2t + 9 (one 16-byte chunk each); byte permutes (prmt) pair a d's bytes of two keys
//    before the conversion. The merge writes each d where it belongs.
// Logits in base 2 (sm_scale * log2(e) * k_scale), P in float16, v_scale applied once at the end.
// The running max is raised only when a tile's max passes it by more than 8 (P <= 2^8, exact in
// float16's relative precision), so most tiles rescale nothing.
//
// PDL (sm_90+): the step's metadata (seq_lens, rows, start and the first tile's slots) is read
// before cudaGridDependencySynchronize unless wait_at_entry; q, the new rows, loc, the scales and
// the cache after it. cudaTriggerProgrammaticLaunchCompletion follows the wait (the next launch
// waits for this whole grid before it reads anything this one writes). The runtime intrinsics,
// never hand-written PTX for them: the intrinsics carry the memory clobber that keeps loads after the wait.

#include "fp8_decode.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kD = 128;
constexpr int kStages = 3;   // tiles in a warp's ring
constexpr int kChunks = 8;   // 16-byte chunks a lane loads a tile: 4 of K, 4 of V
constexpr int kRingBytes = kWarps * kStages * kChunks * 32 * 16;
constexpr int kMergeBytes = kWarps * 8 * (2 + kD) * 4;  // per warp: max, sum, accumulator of 8 heads
constexpr int kMaxDevices = 64;
static_assert(kRingBytes >= kMergeBytes, "the merge reuses the ring");
static_assert(kThreads == kD, "a thread stores one element of the step's K and V rows");
static_assert(kRingBytes <= 48 * 1024, "static shared memory: no opt-in attribute");

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890  // cvt.*.e4m3x2 / e5m2x2: sm_89+

constexpr unsigned kFull = 0xffffffffu;
constexpr int kTile = 16;  // keys a tile

template <bool E5M2>
__device__ __forceinline__ void cvt4(uint32_t w, uint32_t& lo, uint32_t& hi) {  // bytes 0,1 -> lo; 2,3 -> hi
  if (E5M2) {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e5m2x2 %0, l; cvt.rn.f16x2.e5m2x2 %1, h; }"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
  } else {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
  }
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

__device__ __forceinline__ uint32_t movmatrix_t(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// the Triton kernels' tanh (kernels/common.py): 1 - 2 / (exp(2x) + 1), x clamped to [-15, 15]
__device__ __forceinline__ float tanh_clamped(float x) {
  const float e = ex2(fminf(fmaxf(x, -15.f), 15.f) * 2.8853900817779268f);
  return 1.f - __fdividef(2.f, e + 1.f);
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ int64_t load_index(const void* p, int i, int is_int64) {
  return is_int64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

// attnplug.memory.fp8.quantize_kv's rule: x / scale (IEEE), saturated, round to nearest even, NaN -> 0x7F
template <bool E5M2>
__device__ __forceinline__ uint32_t quantize(float x, float scale) {
  constexpr int kMant = E5M2 ? 2 : 3, kEMin = E5M2 ? -14 : -6;
  constexpr uint32_t kMaxBits = E5M2 ? 0x47600000u : 0x43E00000u;  // 57344 / 448
  const uint32_t sign = (__float_as_uint(x) >> 24) & 0x80u;
  uint32_t a = __float_as_uint(__fdiv_rn(x, scale)) & 0x7FFFFFFFu;
  const bool is_nan = a > 0x7F800000u;
  a = min(a, kMaxBits);
  const int e = static_cast<int>(a >> 23) - 127;
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const int sh = min(23 - kMant + max(kEMin - e, 0), 31);
  uint32_t q = m >> sh;
  const uint32_t r = m - (q << sh), half = 1u << (sh - 1);
  q += (r > half || (r == half && (q & 1u))) ? 1u : 0u;
  const uint32_t code = (static_cast<uint32_t>(max(e - kEMin, 0)) << kMant) + q;
  return (is_nan ? 0x7Fu : code) | sign;
}

__device__ __forceinline__ float half_to_float(const void* p, int64_t i, bool fp16) {
  return fp16 ? __half2float(static_cast<const __half*>(p)[i])
              : __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The slot of position pos (table column col), 0 where it is no key: at or past hi, outside the
// table, or a slot outside [1, num_slots)
__device__ __forceinline__ int tile_slot(const int32_t* trow, int pos, int col, int hi, int width, int num_slots) {
  const int s = (pos < hi && col >= 0 && col < width) ? trow[col] : 0;
  return (s >= 1 && s < num_slots) ? s : 0;
}

__device__ __forceinline__ const uint8_t* row_of(const uint8_t* base, int slot, uint32_t row_bytes) {
  return base + static_cast<uint64_t>(static_cast<uint32_t>(slot)) * row_bytes;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {  // src_bytes 0: zeros
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

struct Tile {       // a lane's part of one 16-key tile
  uint4 k0a, k0b;   // key g: bytes [32t, 32t + 32) of its K row
  uint4 k1a, k1b;   // key g + 8
  uint4 v0, v1, v2, v3;  // keys 2t, 2t + 1, 2t + 8, 2t + 9: bytes [16g, 16g + 16) of their V rows
  uint32_t keys;    // bit k: key k of the tile is a key
};

// This lane's chunks of a tile into a ring stage ([chunk][lane] uint4, conflict-free reads) by
// cp.async; V of a column without a key is zeros (P is 0 there, and 0 * NaN would not be), its K
// row is slot 0's (its logit is masked). Returns the tile's key bits.
__device__ __forceinline__ uint32_t issue_tile(uint4* stage, int slot_l, const uint8_t* k_t, const uint8_t* v_g,
                                               uint32_t row_bytes, int g, int t) {
  const int s_g = __shfl_sync(kFull, slot_l, g), s_g8 = __shfl_sync(kFull, slot_l, g + 8);
  const int s_0 = __shfl_sync(kFull, slot_l, 2 * t), s_1 = __shfl_sync(kFull, slot_l, 2 * t + 1);
  const int s_8 = __shfl_sync(kFull, slot_l, 2 * t + 8), s_9 = __shfl_sync(kFull, slot_l, 2 * t + 9);
  const uint4* kg = reinterpret_cast<const uint4*>(row_of(k_t, s_g, row_bytes));
  const uint4* kg8 = reinterpret_cast<const uint4*>(row_of(k_t, s_g8, row_bytes));
  cp_async16(stage, kg, 16);
  cp_async16(stage + 32, kg + 1, 16);
  cp_async16(stage + 64, kg8, 16);
  cp_async16(stage + 96, kg8 + 1, 16);
  cp_async16(stage + 128, row_of(v_g, s_0, row_bytes), s_0 ? 16 : 0);
  cp_async16(stage + 160, row_of(v_g, s_1, row_bytes), s_1 ? 16 : 0);
  cp_async16(stage + 192, row_of(v_g, s_8, row_bytes), s_8 ? 16 : 0);
  cp_async16(stage + 224, row_of(v_g, s_9, row_bytes), s_9 ? 16 : 0);
  return __ballot_sync(kFull, slot_l != 0);  // lanes l and l + 16 hold the same key
}

__device__ __forceinline__ void read_tile(Tile& tile, const uint4* stage, uint32_t keys) {
  tile.k0a = stage[0];
  tile.k0b = stage[32];
  tile.k1a = stage[64];
  tile.k1b = stage[96];
  tile.v0 = stage[128];
  tile.v1 = stage[160];
  tile.v2 = stage[192];
  tile.v3 = stage[224];
  tile.keys = keys;
}

// One tile into the warp's running max (heads 2t, 2t + 1), sum and accumulator.
template <bool E5M2>
__device__ __forceinline__ void attend_tile(const Tile& cur, const uint32_t (&qb)[8][2], float qk_scale,
                                            float softcap_log2, int g, float (&m_run)[2], float (&l_part)[2],
                                            float (&acc)[8][4]) {
  // S^T = K q^T: s0 = (key g, head 2t), s1 = (g, 2t + 1), s2 = (g + 8, 2t), s3 = (g + 8, 2t + 1)
  float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int st = 0; st < 8; ++st) {
    const uint32_t w0 = word(st < 4 ? cur.k0a : cur.k0b, st & 3);
    const uint32_t w1 = word(st < 4 ? cur.k1a : cur.k1b, st & 3);
    uint32_t a0, a1, a2, a3;
    cvt4<E5M2>(w0, a0, a2);
    cvt4<E5M2>(w1, a1, a3);
    mma(s, a0, a1, a2, a3, qb[st][0], qb[st][1]);
  }
  if (softcap_log2 > 0.f) {
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = tanh_clamped(s[i] * qk_scale) * softcap_log2;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] *= qk_scale;
  }
  if (!((cur.keys >> g) & 1u)) s[0] = s[1] = -INFINITY;
  if (!((cur.keys >> (g + 8)) & 1u)) s[2] = s[3] = -INFINITY;
  float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(kFull, mx0, off));
    mx1 = fmaxf(mx1, __shfl_xor_sync(kFull, mx1, off));
  }
  const bool raise = (mx0 > m_run[0] + 8.f) || (mx1 > m_run[1] + 8.f);
  if (__any_sync(kFull, raise)) {
    const float n0 = fmaxf(m_run[0], mx0), n1 = fmaxf(m_run[1], mx1);
    const float a0 = ex2(m_run[0] - n0), a1 = ex2(m_run[1] - n1);
    m_run[0] = n0;
    m_run[1] = n1;
    l_part[0] *= a0;
    l_part[1] *= a1;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      acc[j][0] *= a0;
      acc[j][1] *= a1;
      acc[j][2] *= a0;
      acc[j][3] *= a1;
    }
  }
  const float p0 = ex2(s[0] - m_run[0]), p1 = ex2(s[1] - m_run[1]);
  const float p2 = ex2(s[2] - m_run[0]), p3 = ex2(s[3] - m_run[1]);
  l_part[0] += p0 + p2;
  l_part[1] += p1 + p3;
  const uint32_t pb0 = movmatrix_t(pack_f16x2(p0, p1)), pb1 = movmatrix_t(pack_f16x2(p2, p3));

  // O^T += V^T P^T: m-tile 2i from bytes 0, 1 of word i of the V chunks, m-tile 2i + 1 from bytes 2, 3
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t x0 = word(cur.v0, i), x1 = word(cur.v1, i), x8 = word(cur.v2, i), x9 = word(cur.v3, i);
    const uint32_t e01 = prmt(x0, x1, 0x5140), o01 = prmt(x0, x1, 0x7362);
    const uint32_t e89 = prmt(x8, x9, 0x5140), o89 = prmt(x8, x9, 0x7362);
    uint32_t a0, a1, a2, a3;
    cvt4<E5M2>(e01, a0, a1);
    cvt4<E5M2>(e89, a2, a3);
    mma(acc[2 * i], a0, a1, a2, a3, pb0, pb1);
    cvt4<E5M2>(o01, a0, a1);
    cvt4<E5M2>(o89, a2, a3);
    mma(acc[2 * i + 1], a0, a1, a2, a3, pb0, pb1);
  }
}

#endif  // sm_89+

template <bool E5M2>
__global__ void __launch_bounds__(kThreads, 4) fp8_decode_kernel(const AttnplugFp8DecodeParams p, bool wait_at_entry) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
  __shared__ __align__(16) unsigned char smem[kRingBytes];
  const int b = blockIdx.x / p.num_kv_heads, hk = blockIdx.x % p.num_kv_heads;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (wait_at_entry) {
    cudaGridDependencySynchronize();
    cudaTriggerProgrammaticLaunchCompletion();
  }
#endif
  // the step's metadata: before the PDL wait unless wait_at_entry
  const int hi = static_cast<int>(load_index(p.seq_lens, b, p.seq_lens_int64));
  const int lo = p.window > 0 ? max(hi - p.window, 0) : 0;
  int64_t table_row = load_index(p.rows, b, p.rows_int64);
  if (table_row < 0 || table_row >= p.num_table_rows) table_row = 0;
  const int t_start = p.start ? static_cast<int>(load_index(p.start, b, p.start_int64)) : 0;
  const int32_t* trow = p.table + table_row * p.table_stride;
  const int key_l = lo + (lane & 15);  // this lane's key of the range's tile 0 (of tile n: + 16 n)
  const uint32_t row_bytes = static_cast<uint32_t>(p.kv_stride);
  const uint8_t* k_t = p.k_cache + hk * p.kv_head_stride + 32 * t;
  const uint8_t* v_g = p.v_cache + hk * p.kv_head_stride + 16 * g;
  const int n_tiles = hi > lo ? (hi - lo + kTile - 1) / kTile : 0;
  const int width = p.table_width, num_slots = p.num_slots;
  auto slot_of = [&](int tile) {
    const int pos = key_l + tile * kTile;
    return tile_slot(trow, pos, pos - t_start, hi, width, num_slots);
  };
  const int slot_first = warp < n_tiles ? slot_of(warp) : 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (!wait_at_entry) {
    cudaGridDependencySynchronize();  // q, the new rows, loc, the scales and the cache after the last launch
    cudaTriggerProgrammaticLaunchCompletion();
  }
#endif
  const float k_scale = p.k_scale[hk * p.k_scale_stride], v_scale = p.v_scale[hk * p.v_scale_stride];
  const bool fp16 = p.q_fp16 != 0;
  if (p.new_k != nullptr) {  // the step's row of kv head hk, quantised, at loc[b]; read back as any other key
    const int64_t slot = load_index(p.loc, b, p.loc_int64);
    if (slot >= 1 && slot < num_slots) {
      const int d = threadIdx.x;  // kThreads == kD
      const int64_t dst = slot * p.kv_stride + hk * p.kv_head_stride + d;
      p.k_cache[dst] = static_cast<uint8_t>(quantize<E5M2>(half_to_float(p.new_k, b * p.new_k_stride_t + hk * kD + d, fp16), k_scale));
      p.v_cache[dst] = static_cast<uint8_t>(quantize<E5M2>(half_to_float(p.new_v, b * p.new_v_stride_t + hk * kD + d, fp16), v_scale));
    }
    __syncthreads();
  }

  // q^T's B fragments: head g of the group, elements 32t + 4s + {0, 1} and {2, 3} (the permuted
  // head dim) of k-step s, in float16
  uint32_t qb[8][2];
  if (g < p.group) {
    const int64_t q0 = b * p.q_stride_t + static_cast<int64_t>(hk * p.group + g) * p.q_stride_h + 32 * t;
#pragma unroll
    for (int st = 0; st < 8; ++st) {
      const int64_t e = q0 + 4 * st;
      qb[st][0] = pack_f16x2(half_to_float(p.q, e, fp16), half_to_float(p.q, e + 1, fp16));
      qb[st][1] = pack_f16x2(half_to_float(p.q, e + 2, fp16), half_to_float(p.q, e + 3, fp16));
    }
  } else {
#pragma unroll
    for (int st = 0; st < 8; ++st) qb[st][0] = qb[st][1] = 0u;
  }
  const float qk_scale = p.qk_scale * k_scale;

  float m_run[2] = {-1.0e30f, -1.0e30f};
  float l_part[2] = {0.f, 0.f};
  float acc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // the warp's tiles warp, warp + 4, ... through its ring: tile i in stage i % kStages, tiles
  // i + 1 and i + 2 in flight while tile i is read
  uint4* ring = reinterpret_cast<uint4*>(smem) + warp * kStages * kChunks * 32 + lane;
  uint32_t keys_cur = 0, keys_next = 0;
  if (warp < n_tiles) keys_cur = issue_tile(ring, slot_first, k_t, v_g, row_bytes, g, t);
  cp_async_commit();
  if (warp + kWarps < n_tiles) keys_next = issue_tile(ring + kChunks * 32, slot_of(warp + kWarps), k_t, v_g, row_bytes, g, t);
  cp_async_commit();
  int tile = warp;
  int slot_ahead = tile + 2 * kWarps < n_tiles ? slot_of(tile + 2 * kWarps) : 0;
  for (int i = 0; tile < n_tiles; ++i, tile += kWarps) {
    const int ahead = tile + 2 * kWarps;
    uint32_t keys_ahead = 0;
    if (ahead < n_tiles) {
      keys_ahead = issue_tile(ring + ((i + 2) % kStages) * kChunks * 32, slot_ahead, k_t, v_g, row_bytes, g, t);
    }
    cp_async_commit();
    if (ahead + kWarps < n_tiles) slot_ahead = slot_of(ahead + kWarps);  // its table load in flight too
    cp_async_wait<kStages - 1>();  // tile i's group has landed (a lane reads only its own chunks)
    Tile cur;
    read_tile(cur, ring + (i % kStages) * kChunks * 32, keys_cur);
    attend_tile<E5M2>(cur, qb, qk_scale, p.softcap_log2, g, m_run, l_part, acc);
    keys_cur = keys_next;
    keys_next = keys_ahead;
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with its ring: the merge reuses the memory

  float(*sm_m)[8] = reinterpret_cast<float(*)[8]>(smem);
  float(*sm_l)[8] = reinterpret_cast<float(*)[8]>(smem + kWarps * 8 * 4);
  float(*sm_acc)[8][kD] = reinterpret_cast<float(*)[8][kD]>(smem + 2 * kWarps * 8 * 4);
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {  // the warp's sums over its lanes' keys
    l_part[0] += __shfl_xor_sync(kFull, l_part[0], off);
    l_part[1] += __shfl_xor_sync(kFull, l_part[1], off);
  }
  if (g == 0) {
    sm_m[warp][2 * t] = m_run[0];
    sm_m[warp][2 * t + 1] = m_run[1];
    sm_l[warp][2 * t] = l_part[0];
    sm_l[warp][2 * t + 1] = l_part[1];
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int d0 = 16 * g + 2 * j;
    sm_acc[warp][2 * t][d0] = acc[j][0];
    sm_acc[warp][2 * t + 1][d0] = acc[j][1];
    sm_acc[warp][2 * t][d0 + 1] = acc[j][2];
    sm_acc[warp][2 * t + 1][d0 + 1] = acc[j][3];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.group * kD; e += kThreads) {
    const int h = e / kD, d = e % kD;
    float m = sm_m[0][h];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) m = fmaxf(m, sm_m[w][h]);
    float sink = 0.f;
    if (p.sinks != nullptr) {  // the head's sink joins the denominator (base 2)
      sink = p.sinks[hk * p.group + h] * 1.4426950408889634f;
      m = fmaxf(m, sink);
    }
    float l = p.sinks != nullptr ? ex2(sink - m) : 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float a = ex2(sm_m[w][h] - m);
      l += a * sm_l[w][h];
      o += a * sm_acc[w][h][d];
    }
    const float r = l > 0.f ? o * v_scale / l : 0.f;
    const int64_t oi = b * p.out_stride_t + static_cast<int64_t>(hk * p.group + h) * p.out_stride_h + d;
    if (fp16) {
      static_cast<__half*>(p.out)[oi] = __float2half_rn(r);
    } else {
      static_cast<__nv_bfloat16*>(p.out)[oi] = __float2bfloat16(r);
    }
  }
#endif  // sm_89+
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The virtual architecture of the kernel image that runs on `device` (0 on error, `err` set):
// below 89 the image is empty, below 90 it has no grid-dependency wait.
template <bool E5M2>
int image_arch(int device, cudaError_t* err) {
  static std::atomic<int> cache[kMaxDevices];
  if (device >= 0 && device < kMaxDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  cudaFuncAttributes attr;
  const cudaError_t e = cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(&fp8_decode_kernel<E5M2>));
  if (e != cudaSuccess) {
    *err = e;
    return 0;
  }
  const int version = attr.ptxVersion > 0 ? attr.ptxVersion : attr.binaryVersion;
  if (device >= 0 && device < kMaxDevices) cache[device].store(version, std::memory_order_relaxed);
  return version;
}

}  // namespace

extern "C" const char* attnplug_fp8_decode_problem(const AttnplugFp8DecodeParams* params) {
  if (params == nullptr) return "no parameters";
  const AttnplugFp8DecodeParams& p = *params;
  if (p.group != 1 && p.group != 2 && p.group != 4 && p.group != 8) return "the group (q heads a kv head) must be 1, 2, 4 or 8";
  if (p.num_reqs < 0 || p.num_kv_heads < 1 || p.num_slots < 1 || p.num_table_rows < 1 || p.table_width < 0) {
    return "counts out of range (requests >= 0, kv heads, slots and table rows >= 1)";
  }
  if (static_cast<int64_t>(p.num_reqs) * p.num_kv_heads > 0x7fffffff) return "requests x kv heads exceed the grid";
  if (p.kv_stride <= 0 || p.kv_stride > 0x7fffffff) return "the caches' slot stride must be in [1, 2^31) bytes";
  if (p.kv_stride % 16 != 0 || p.kv_head_stride % 16 != 0 || !aligned16(p.k_cache) || !aligned16(p.v_cache)) {
    return "the caches' rows must be 16-byte aligned (base, slot stride and kv head stride)";
  }
  if (p.kv_head_stride < 0 || (p.num_kv_heads - 1) * p.kv_head_stride + kD > p.kv_stride) {
    return "the caches' kv heads overlap or leave their slot";
  }
  return nullptr;
}

extern "C" cudaError_t attnplug_fp8_decode_launch(const AttnplugFp8DecodeParams* params, bool pdl, bool wait_at_entry,
                                                  cudaStream_t stream, bool* pdl_used) {
  if (pdl_used != nullptr) *pdl_used = false;
  if (attnplug_fp8_decode_problem(params) != nullptr) return cudaErrorInvalidValue;
  const AttnplugFp8DecodeParams& p = *params;
  if (p.num_reqs == 0) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const int arch = p.e5m2 ? image_arch<true>(device, &err) : image_arch<false>(device, &err);
  if (err != cudaSuccess) return err;
  if (arch < 89) return cudaErrorNoKernelImageForDevice;
  const bool use_pdl = pdl && arch >= 90;  // only an sm_90+ image holds the wait

  cudaLaunchAttribute attrs[1];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned int>(p.num_reqs * p.num_kv_heads), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cfg.attrs = use_pdl ? attrs : nullptr;
  cfg.numAttrs = use_pdl ? 1 : 0;
  err = p.e5m2 ? cudaLaunchKernelEx(&cfg, fp8_decode_kernel<true>, p, wait_at_entry)
               : cudaLaunchKernelEx(&cfg, fp8_decode_kernel<false>, p, wait_at_entry);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the non-sticky launch error
    return err;
  }
  if (pdl_used != nullptr) *pdl_used = use_pdl;
  return cudaSuccess;
}
