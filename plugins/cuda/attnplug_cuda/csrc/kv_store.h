// attnplug CUDA plugin: KV store kernel, plain C++ launcher interface.
//
// This header is deliberately free of torch headers so that kv_store.cu can be
// compiled with a bare `nvcc -arch=sm_90 -c kv_store.cu` (CI does this on a
// machine without a GPU). The torch binding lives in kv_store_binding.cpp.
//
// Semantics, for every new token t in [0, num_tokens):
//     slot = loc[t]
//     if 1 <= slot < num_slots:
//         k_cache[slot, :] = k[t, :]      (row_elems elements)
//         v_cache[slot, :] = v[t, :]
// Slots outside [1, num_slots) are skipped (never written): the kernel cannot
// raise without a host sync, and writing outside the step's slots is the one
// thing a KV store must never do. Slot 0 is the padding sink of the attnplug
// pools (padded tokens point there) and -1 means "no slot": neither is
// written. The Triton store (kernels/kv_store.py) applies the same rule.
//
// Rows are copied bit for bit; the dtype only fixes the element size.
// Strides are in ELEMENTS between consecutive rows (tokens for k/v, slots for
// the caches); the Hkv*D elements of one row must be contiguous.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

// Element types accepted by the launcher (k, v, k_cache and v_cache share one).
enum AttnplugDtype : int {
  ATTNPLUG_DTYPE_FLOAT32 = 0,
  ATTNPLUG_DTYPE_FLOAT16 = 1,
  ATTNPLUG_DTYPE_BFLOAT16 = 2,
};

extern "C" {

// Element size in bytes of an AttnplugDtype, or 0 for an unknown code.
int attnplug_dtype_size(int dtype_code);

// Width in bytes (16, 8, 4, 2 or 1) of the loads/stores the kernel will use
// for these pointers and strides: the widest width that divides the row size,
// every base address and every row stride in bytes. 16 is the fast path; the
// narrower widths are the fallback for unaligned rows. Returns 0 on bad input.
int attnplug_kv_store_vec_bytes(const void* k, const void* v, const void* k_cache,
                                const void* v_cache, int dtype_code, int64_t row_elems,
                                int64_t k_stride, int64_t v_stride, int64_t kc_stride,
                                int64_t vc_stride);

// Enqueue the KV store on `stream`. Returns the first CUDA error met (argument
// errors as cudaErrorInvalidValue), cudaSuccess otherwise; it never syncs.
//
// pdl: request Programmatic Dependent Launch (launch attribute
// cudaLaunchAttributeProgrammaticStreamSerialization = 1). It is applied only
// when the kernel image that runs on the current device was built for sm_90 or
// newer (i.e. it contains the cudaGridDependencySynchronize wait); otherwise
// the kernel is launched plainly. *pdl_used (may be null) reports which.
cudaError_t attnplug_kv_store_launch(const void* k, const void* v, void* k_cache, void* v_cache,
                                     const void* loc, bool loc_is_int64, int dtype_code,
                                     int64_t num_tokens, int64_t num_slots, int64_t row_elems,
                                     int64_t k_stride, int64_t v_stride, int64_t kc_stride,
                                     int64_t vc_stride, bool pdl, cudaStream_t stream,
                                     bool* pdl_used);

}  // extern "C"
