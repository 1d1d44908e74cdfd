// attnplug CUDA plugin: small-step attention with each CTA's keys staged in shared memory
// before the PDL wait (staged_attend.cu).
//
// Free of torch headers: `nvcc -arch=sm_90 -c staged_attend.cu` compiles it alone; the torch
// binding is staged_attend_binding.cpp.
//
// Semantics: those of the Triton kernel store_attend (kernels/store_attend.py) for fp16 /
// bf16, head_dim 64 or 128 and at most 16 (token, q head) rows per (request, kv head)
// group: store the step's K/V rows at loc (slots outside [1, num_slots) skipped; loc null:
// nothing stored, every key read from the cache), attend the step's queries over the paged
// cache (table lookup, causal, optional window, softcap, sinks) and write out.
//
// Work split: `splits` CTAs per (request, kv head) group, each over one share of the group's
// KV range (store_attend's rule: whole 16-key steps). A CTA stages its share in passes of
// at most `capacity` keys; the first pass's cached rows are copied before the PDL wait, so a
// layer whose shares fit one pass only waits for q and the step's own K/V. With splits > 1
// each CTA writes a normalised partial to `workspace` and the last CTA of the group (an
// atomic ticket) merges the partials in split order.
//
// With `resident` the launch runs resident_attend.cu instead: one CTA a group (splits 1),
// whose cached keys (at most attnplug_resident_attend_capacity(head_dim) positions before the
// step's first token; the host bounds guarantee it) are loaded into registers before the PDL
// wait; `capacity` is then that capacity.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

// Element types (q, k, v, the caches and out share one).
enum AttnplugStagedDtype : int {
  STAGED_ATTEND_FLOAT16 = 1,
  STAGED_ATTEND_BFLOAT16 = 2,
};

extern "C" {

struct AttnplugStagedAttendArgs {
  const void* q;          // [T, H, D]; strides stride_qt, stride_qh (elements), last dim dense
  const void* k_new;      // [T, Hkv, D]; token stride stride_knt, dense [Hkv, D] rows
  const void* v_new;      // same layout, token stride stride_vnt
  const void* loc;        // [T] int32 / int64 slots, or null: nothing stored
  void* k_cache;          // [S, Hkv, D] contiguous
  void* v_cache;
  void* out;              // [T, H, D]; strides stride_ot, stride_oh
  float* workspace;       // split partials (splits > 1): attnplug_staged_attend_workspace_bytes
  int32_t* tickets;       // [num_reqs * num_kv_heads], zero-filled once; every launch leaves it zero
  const int32_t* cu_q_lens;  // [bs + 1]
  const void* seq_lens;      // [bs] int32 / int64: KV length including the new tokens
  const int32_t* table;      // [R, table_width], row stride stride_table
  const void* table_rows;    // [bs] int32 / int64
  const void* table_start;   // [bs] int32 / int64, or null: 0
  const float* sinks;        // [H] natural-log sink logits, or null
  int64_t* trace;            // phase stamps (%globaltimer, ns), 8 per CTA at (group * splits + split) * 8, or null:
                             // 0 entry, 1 first pass's cached copies issued, 2 past the PDL wait, 3 keys folded,
                             // 4 output written (one split) or ticket taken, 5 splits merged (the merging CTA),
                             // 6 first pass's keys in shared memory
  int64_t stride_qt, stride_qh, stride_knt, stride_vnt, stride_ot, stride_oh, stride_table;
  int64_t num_slots;
  int32_t table_width, table_rows_len;
  int32_t num_reqs, num_kv_heads, group;  // group: q heads per kv head
  int32_t head_dim;
  int32_t window;     // 0: no window
  int32_t splits;     // CTAs per group, >= 1
  int32_t capacity;   // keys one pass stages: a multiple of 128, at most the maximum for head_dim
  float qk_scale;     // base-2 logits: qk * qk_scale (softcap: tanh(qk * qk_scale) * softcap_log2)
  float softcap_log2; // 0: no softcap
  int32_t dtype;      // AttnplugStagedDtype
  bool loc_is_int64, seq_lens_is_int64, table_rows_is_int64, table_start_is_int64;
  bool pdl;           // launch with Programmatic Dependent Launch
  bool prologue;      // with pdl: read metadata, table entries and cached K/V before the wait
  bool release_early; // with pdl: release the dependents right after the wait
  bool resident;      // the register-resident kernel (resident_attend.cu): splits 1, capacity its own
};

// Most keys one pass stages for this head_dim (0: head_dim not served).
int attnplug_staged_attend_max_capacity(int head_dim);

// Most cached keys (positions before the step's first token) of a group the resident kernel
// holds in registers for this head_dim (0: head_dim not served).
int attnplug_resident_attend_capacity(int head_dim);

// Enqueue the resident kernel (arguments checked by attnplug_staged_attend_launch).
cudaError_t attnplug_resident_attend_launch(const AttnplugStagedAttendArgs* a, cudaStream_t stream, bool* pdl_used);

// Bytes of the split-partial workspace for `programs` CTAs (groups x splits) of this head_dim
// with 16-bit elements.
size_t attnplug_staged_attend_workspace_bytes(int programs, int head_dim);

// Whether these arguments are served (dtype, head_dim, group, rows, splits, capacity, 16-byte
// alignment of every row): null when they are, else a static message naming the problem.
const char* attnplug_staged_attend_unsupported(const AttnplugStagedAttendArgs* a, int max_q_len);

// Enqueue the launch on `stream`; never syncs. Returns the first CUDA error met
// (unsupported arguments as cudaErrorInvalidValue, a device below compute capability 8.0 as
// cudaErrorNotSupported); *pdl_used (may be null) reports whether the launch used PDL (only
// on compute capability 9.0 and above).
cudaError_t attnplug_staged_attend_launch(const AttnplugStagedAttendArgs* a, int max_q_len, cudaStream_t stream,
                                          bool* pdl_used);

}  // extern "C"
