// attnplug CUDA plugin: KV store kernel with Programmatic Dependent Launch.
//
// No torch headers here (see kv_store.h): CI compiles this file alone with
//     nvcc -arch=sm_90 -c kv_store.cu
//
// Work split: a group of `threads_per_token` threads copies the whole row
// (all Hkv heads x D) of one token into the K and the V cache; a block holds
// `tokens_per_block` such groups, and the grid strides over the tokens. Loads
// and stores are as wide as the alignment allows (16 bytes on the fast path).
//
// PDL: on sm_90+ the kernel waits for its predecessor grid
// (cudaGridDependencySynchronize) before it reads k, v or loc, which the
// previous kernel may have written, and lets its dependents launch
// (cudaTriggerProgrammaticLaunchCompletion) only after its last store. The
// CUDA runtime intrinsics are used on purpose: hand-written inline PTX for
// these instructions lacks the memory clobber, so the compiler could move
// loads above the wait or stores below the trigger.

#include "kv_store.h"

#include <atomic>
#include <climits>
#include <cstdint>

namespace {

constexpr int kMaxThreadsPerBlock = 256;
constexpr int kMaxDevices = 64;
// Grid cap; the kernel strides over the remaining tokens.
constexpr int64_t kMaxBlocks = int64_t(1) << 30;

struct KvStoreArgs {
  const void* k;
  const void* v;
  void* k_cache;
  void* v_cache;
  const void* loc;
  int64_t num_tokens;
  int64_t num_slots;
  int64_t row_vecs;   // vectors per row
  int64_t k_stride;   // row strides, in vectors
  int64_t v_stride;
  int64_t kc_stride;
  int64_t vc_stride;
  int threads_per_token;
  int tokens_per_block;
};

template <typename VecT>
__device__ __forceinline__ VecT load_readonly(const VecT* p) {
  return __ldg(p);
}

template <typename VecT, typename IdxT>
__global__ void __launch_bounds__(kMaxThreadsPerBlock) kv_store_kernel(const KvStoreArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // k, v and loc may come from the kernel launched just before this one.
  cudaGridDependencySynchronize();
#endif
  const VecT* __restrict__ k = static_cast<const VecT*>(a.k);
  const VecT* __restrict__ v = static_cast<const VecT*>(a.v);
  VecT* __restrict__ k_cache = static_cast<VecT*>(a.k_cache);
  VecT* __restrict__ v_cache = static_cast<VecT*>(a.v_cache);
  const IdxT* __restrict__ loc = static_cast<const IdxT*>(a.loc);

  const int group = static_cast<int>(threadIdx.x) / a.threads_per_token;
  const int lane = static_cast<int>(threadIdx.x) - group * a.threads_per_token;
  const int64_t token_step = static_cast<int64_t>(gridDim.x) * a.tokens_per_block;

  for (int64_t t = static_cast<int64_t>(blockIdx.x) * a.tokens_per_block + group;
       t < a.num_tokens; t += token_step) {
    const int64_t slot = static_cast<int64_t>(loc[t]);
    if (slot < 1 || slot >= a.num_slots) {
      continue;  // the sink (0), "no slot" (-1) and garbage: never written (as the Triton store)
    }
    const VecT* __restrict__ k_row = k + t * a.k_stride;
    const VecT* __restrict__ v_row = v + t * a.v_stride;
    VecT* __restrict__ kc_row = k_cache + slot * a.kc_stride;
    VecT* __restrict__ vc_row = v_cache + slot * a.vc_stride;
    for (int64_t i = lane; i < a.row_vecs; i += a.threads_per_token) {
      const VecT kv = load_readonly(k_row + i);
      const VecT vv = load_readonly(v_row + i);
      kc_row[i] = kv;
      vc_row[i] = vv;
    }
  }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // After this thread's last store: dependents may start their prologue.
  cudaTriggerProgrammaticLaunchCompletion();
#endif
}

bool aligned_to(const void* p, int64_t w) {
  return (reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(w)) == 0;
}

// Virtual architecture (major*10+minor, the __CUDA_ARCH__ the device code was
// compiled for) of the image of this kernel that runs on `device`, cached per
// device. The PDL calls exist in that image iff it is >= 90. Returns 0 on
// error (then `err` is set).
template <typename VecT, typename IdxT>
int kernel_binary_version(int device, cudaError_t* err) {
  static std::atomic<int> cache[kMaxDevices];
  if (device >= 0 && device < kMaxDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) {
      return cached;
    }
  }
  cudaFuncAttributes attr;
  const cudaError_t e =
      cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(&kv_store_kernel<VecT, IdxT>));
  if (e != cudaSuccess) {
    *err = e;
    return 0;
  }
  // ptxVersion is the virtual architecture (what __CUDA_ARCH__ was); a PTX
  // image JIT-compiled for a newer GPU has a larger binaryVersion but keeps
  // the code of its older virtual architecture.
  const int version = attr.ptxVersion > 0 ? attr.ptxVersion : attr.binaryVersion;
  if (device >= 0 && device < kMaxDevices) {
    cache[device].store(version, std::memory_order_relaxed);
  }
  return version;
}

template <typename VecT, typename IdxT>
cudaError_t launch_typed(const KvStoreArgs& base, bool pdl, cudaStream_t stream,
                         bool* pdl_used) {
  KvStoreArgs a = base;
  const int64_t vb = static_cast<int64_t>(sizeof(VecT));
  a.k_stride /= vb;
  a.v_stride /= vb;
  a.kc_stride /= vb;
  a.vc_stride /= vb;
  a.row_vecs /= vb;

  // Threads per token: a power of two up to one warp for short rows (several
  // tokens then share a warp), whole warps beyond that, at most one block.
  int tpt;
  if (a.row_vecs >= kMaxThreadsPerBlock) {
    tpt = kMaxThreadsPerBlock;
  } else if (a.row_vecs > 32) {
    tpt = static_cast<int>((a.row_vecs + 31) / 32 * 32);
  } else {
    tpt = 1;
    while (tpt < a.row_vecs) {
      tpt <<= 1;
    }
  }
  a.threads_per_token = tpt;
  a.tokens_per_block = kMaxThreadsPerBlock / tpt;  // >= 1
  int64_t blocks = (a.num_tokens + a.tokens_per_block - 1) / a.tokens_per_block;
  if (blocks > kMaxBlocks) {
    blocks = kMaxBlocks;
  }

  bool use_pdl = false;
  if (pdl) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) {
      return err;
    }
    err = cudaSuccess;
    const int version = kernel_binary_version<VecT, IdxT>(device, &err);
    if (err != cudaSuccess) {
      return err;
    }
    // Only an sm_90+ image holds the grid-dependency wait; launching an older
    // image with the attribute would let it read before its producer is done.
    use_pdl = version >= 90;
  }

  cudaLaunchAttribute attrs[1];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;

  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned int>(blocks), 1, 1);
  cfg.blockDim = dim3(static_cast<unsigned int>(tpt * a.tokens_per_block), 1, 1);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cfg.attrs = use_pdl ? attrs : nullptr;
  cfg.numAttrs = use_pdl ? 1 : 0;

  const cudaError_t err = cudaLaunchKernelEx(&cfg, kv_store_kernel<VecT, IdxT>, a);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the non-sticky launch error
    return err;
  }
  if (pdl_used != nullptr) {
    *pdl_used = use_pdl;
  }
  return cudaSuccess;
}

template <typename VecT>
cudaError_t launch_by_index(const KvStoreArgs& a, bool loc_is_int64, bool pdl,
                            cudaStream_t stream, bool* pdl_used) {
  if (loc_is_int64) {
    return launch_typed<VecT, int64_t>(a, pdl, stream, pdl_used);
  }
  return launch_typed<VecT, int32_t>(a, pdl, stream, pdl_used);
}

}  // namespace

extern "C" int attnplug_dtype_size(int dtype_code) {
  switch (dtype_code) {
    case ATTNPLUG_DTYPE_FLOAT32:
      return 4;
    case ATTNPLUG_DTYPE_FLOAT16:
    case ATTNPLUG_DTYPE_BFLOAT16:
      return 2;
    default:
      return 0;
  }
}

extern "C" int attnplug_kv_store_vec_bytes(const void* k, const void* v, const void* k_cache,
                                           const void* v_cache, int dtype_code,
                                           int64_t row_elems, int64_t k_stride,
                                           int64_t v_stride, int64_t kc_stride,
                                           int64_t vc_stride) {
  const int64_t es = attnplug_dtype_size(dtype_code);
  if (es == 0 || row_elems <= 0 || k_stride < 0 || v_stride < 0 || kc_stride < 0 ||
      vc_stride < 0) {
    return 0;
  }
  const int64_t row_bytes = row_elems * es;
  const int64_t strides[4] = {k_stride * es, v_stride * es, kc_stride * es, vc_stride * es};
  const void* ptrs[4] = {k, v, k_cache, v_cache};
  for (int64_t w = 16; w > 1; w /= 2) {
    bool ok = (row_bytes % w) == 0;
    for (int i = 0; ok && i < 4; ++i) {
      ok = aligned_to(ptrs[i], w) && (strides[i] % w) == 0;
    }
    if (ok) {
      return static_cast<int>(w);
    }
  }
  return 1;
}

extern "C" cudaError_t attnplug_kv_store_launch(const void* k, const void* v, void* k_cache,
                                                void* v_cache, const void* loc,
                                                bool loc_is_int64, int dtype_code,
                                                int64_t num_tokens, int64_t num_slots,
                                                int64_t row_elems, int64_t k_stride,
                                                int64_t v_stride, int64_t kc_stride,
                                                int64_t vc_stride, bool pdl,
                                                cudaStream_t stream, bool* pdl_used) {
  if (pdl_used != nullptr) {
    *pdl_used = false;
  }
  const int64_t es = attnplug_dtype_size(dtype_code);
  if (es == 0 || num_tokens < 0 || num_slots < 0 || row_elems <= 0) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0) {
    return cudaSuccess;  // nothing to store, nothing launched
  }
  if (k == nullptr || v == nullptr || k_cache == nullptr || v_cache == nullptr ||
      loc == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int vec = attnplug_kv_store_vec_bytes(k, v, k_cache, v_cache, dtype_code, row_elems,
                                              k_stride, v_stride, kc_stride, vc_stride);
  if (vec == 0) {
    return cudaErrorInvalidValue;
  }

  // Byte quantities here; launch_typed turns them into vector counts.
  KvStoreArgs a = {};
  a.k = k;
  a.v = v;
  a.k_cache = k_cache;
  a.v_cache = v_cache;
  a.loc = loc;
  a.num_tokens = num_tokens;
  a.num_slots = num_slots;
  a.row_vecs = row_elems * es;
  a.k_stride = k_stride * es;
  a.v_stride = v_stride * es;
  a.kc_stride = kc_stride * es;
  a.vc_stride = vc_stride * es;

  switch (vec) {
    case 16:
      return launch_by_index<uint4>(a, loc_is_int64, pdl, stream, pdl_used);
    case 8:
      return launch_by_index<uint2>(a, loc_is_int64, pdl, stream, pdl_used);
    case 4:
      return launch_by_index<unsigned int>(a, loc_is_int64, pdl, stream, pdl_used);
    case 2:
      return launch_by_index<unsigned short>(a, loc_is_int64, pdl, stream, pdl_used);
    default:
      return launch_by_index<unsigned char>(a, loc_is_int64, pdl, stream, pdl_used);
  }
}
