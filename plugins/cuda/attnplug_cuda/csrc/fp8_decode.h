// attnplug CUDA plugin: decode attention over an FP8 paged KV cache, plain C++ launcher interface.
//
// Free of torch headers, so fp8_decode.cu compiles with a bare `nvcc -arch=sm_90 -c` (CI, no GPU);
// the torch binding is fp8_decode_binding.cpp.
//
// One new token a request (a decode step), head dim 128, 1, 2, 4 or 8 q heads a kv head. For
// request b and kv head h (one CTA each):
//   1. with new_k: the step's row is stored first, quantised (attnplug.memory.fp8.quantize_kv's
//      rule: x / scale in IEEE float32, saturated to the format's largest finite value, rounded
//      to nearest even, NaN -> 0x7F), at slot loc[b] when 1 <= loc[b] < num_slots;
//   2. keys are the positions [lo, hi) with hi = seq_lens[b] and lo = max(hi - window, 0)
//      (window <= 0: lo = 0); position p's slot is table[row, p - start[b]] (row = rows[b], row 0
//      when outside the table; start null: 0); a column outside the table, or a slot outside
//      [1, num_slots), is no key (never read);
//   3. out[b, h * G + j] = sum_p softmax_p(s_p) * v_scale[h] * V[p] with
//      s_p = sm_scale * k_scale[h] * (q . K[p]), or c * tanh(s_p / c) with a soft cap c, and
//      sinks[head] (natural log) joining the softmax's denominator only. A request without keys
//      (and without a sink) gets zeros.
// q is converted to float16 (bf16 q rounded), K and V bytes to float16; products in float16 with
// float32 accumulation, the softmax in float32 (base 2).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

struct AttnplugFp8DecodeParams {
  const void* q;   // [bs, H, 128] bf16 or fp16; strides in elements (any)
  void* out;       // [bs, H, 128] q's dtype; strides in elements (any)
  uint8_t* k_cache;  // [S, Hkv, 128] FP8 bytes; rows 16-byte aligned (the launcher checks)
  uint8_t* v_cache;  // same layout as k_cache
  const int32_t* table;  // [num_table_rows, table_width], row stride table_stride, columns dense
  const void* rows;      // [bs] int32 / int64 (rows_int64)
  const void* start;     // [bs] int32 / int64 (start_int64), or null
  const void* seq_lens;  // [bs] int32 / int64 (seq_lens_int64): keys including the new token
  const float* k_scale;  // [Hkv] at k_scale_stride (0: one value for every head)
  const float* v_scale;
  const float* sinks;    // [H] contiguous, or null
  const void* new_k;     // [bs, Hkv, 128] q's dtype, heads dense; null: nothing stored
  const void* new_v;
  const void* loc;       // [bs] int32 / int64 (loc_int64)
  int64_t k_scale_stride, v_scale_stride;
  int64_t q_stride_t, q_stride_h, out_stride_t, out_stride_h;
  int64_t new_k_stride_t, new_v_stride_t;
  int64_t kv_stride, kv_head_stride;  // bytes between two slots / two kv heads of the caches
  int64_t table_stride;
  int32_t table_width, num_table_rows, num_slots, num_kv_heads, num_reqs;
  int32_t group;   // q heads a kv head: 1, 2, 4 or 8
  int32_t window;  // <= 0: a full layer
  int32_t rows_int64, start_int64, seq_lens_int64, loc_int64;
  int32_t e5m2;    // the cache is float8_e5m2 (else float8_e4m3fn)
  int32_t q_fp16;  // q is float16 (else bfloat16)
  float qk_scale;      // sm_scale * log2(e), or sm_scale / c with a soft cap c
  float softcap_log2;  // c * log2(e), or 0: no soft cap
};

extern "C" {

// Why these parameters cannot be launched (a static string), or null: a group other than
// 1 / 2 / 4 / 8, cache rows or kv heads not 16-byte aligned, a slot stride over 2 GiB, a count
// out of range. Nothing is read through the pointers.
const char* attnplug_fp8_decode_problem(const AttnplugFp8DecodeParams* params);

// Enqueue the decode on `stream`; never syncs. pdl: launched with programmatic stream
// serialization, the kernel reading the step's metadata (seq_lens, rows, start, the table) before
// its grid-dependency wait unless wait_at_entry, and everything else after it; it lets the next
// launch start right after the wait. Returns the first CUDA error (cudaErrorInvalidValue for
// parameters attnplug_fp8_decode_problem refuses, cudaErrorNoKernelImageForDevice below sm_89).
// PDL is applied only where the kernel image on the device is sm_90+ (it holds the wait);
// *pdl_used (may be null) says whether it was.
cudaError_t attnplug_fp8_decode_launch(const AttnplugFp8DecodeParams* params, bool pdl, bool wait_at_entry,
                                       cudaStream_t stream, bool* pdl_used);

}  // extern "C"
