// attnplug CUDA plugin: the device helpers of the attention kernels written in CUDA C++
// (staged_attend.cu here; benchmarks/cluster_merge/cluster_attend.cu): 16-bit element traits,
// the m16n8k16 tensor-core MMA, 16-byte asynchronous copies into shared memory, ldmatrix loads,
// the KV split rule and index reads. Free of torch headers. Every instruction here needs sm_80 or newer; below
// that the helpers compile to nothing (the kernels that use them are guarded the same way).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace attnplug_dev {

template <typename T>
struct Elem;

template <>
struct Elem<__half> {
  using Pair = __half2;
  __device__ static Pair pair(float lo, float hi) { return __floats2half2_rn(lo, hi); }
  __device__ static __half from_float(float x) { return __float2half_rn(x); }
  __device__ static float to_float(__half x) { return __half2float(x); }
};

template <>
struct Elem<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  __device__ static Pair pair(float lo, float hi) { return __floats2bfloat162_rn(lo, hi); }
  __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
};

// Two floats as one register of two 16-bit values (lo in the low half), an MMA operand.
template <typename T>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  const typename Elem<T>::Pair p = Elem<T>::pair(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&p);
}

// c += a * b for one m16n8k16 tile: a row-major 16x16, b column-major 16x8, c fp32 16x8.
#define ATTNPLUG_TC_MMA(TYPE)                                                                        \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                                \
               ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                        \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                     \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

template <typename T>
__device__ __forceinline__ void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same<T, __half>::value) {
    ATTNPLUG_TC_MMA("f16");
  } else {
    ATTNPLUG_TC_MMA("bf16");
  }
#endif
}

#undef ATTNPLUG_TC_MMA

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes from global to shared memory, asynchronously; src_bytes 0 zero-fills.
__device__ __forceinline__ void copy16(void* dst, const void* src, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
#endif
}

// Every copy16 this thread issued has landed.
__device__ __forceinline__ void copies_done() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\ncp.async.wait_all;\n" ::: "memory");
#endif
}

// Four 8x8 16-bit matrices (transposed with kTrans); thread 8m + r names row r of matrix m.
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(const void* row, uint32_t* d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(smem_addr(row)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(smem_addr(row)));
  }
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(const void* row, uint32_t* d) { ldmatrix_x4<true>(row, d); }

// Two 8x8 16-bit matrices, transposed; threads 0..15 name the rows.
__device__ __forceinline__ void ldmatrix_x2_trans(const void* row, uint32_t* d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(d[0]), "=r"(d[1])
               : "r"(smem_addr(row)));
#endif
}

// Split `split` of `splits` over the key positions [kv_lo, kv_hi), in whole 16-key steps cut
// from the real length (the rule of the Triton kernel store_attend): writes its [lo, hi).
__device__ __forceinline__ void split_share(int kv_lo, int kv_hi, int splits, int split, int* lo, int* hi) {
  if (splits > 1) {
    const int per = (kv_hi - kv_lo + splits - 1) / splits;
    const int chunk = (per + 15) / 16 * 16;
    *lo = min(kv_lo + split * chunk, kv_hi);
    *hi = min(*lo + chunk, kv_hi);
  } else {
    *lo = kv_lo;
    *hi = kv_hi;
  }
}

// Element i of an int32 or int64 index array.
__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, bool is64) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) % 16) == 0; }

}  // namespace attnplug_dev
