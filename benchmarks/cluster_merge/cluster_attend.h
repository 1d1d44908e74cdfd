// One-launch small-step attention whose KV splits meet in a thread-block cluster:
// the kernel benchmarks/cluster_merge.py measures against the plugin's store_attend.
//
// Free of torch headers: `nvcc -arch=sm_90 -I plugins/cuda/attnplug_cuda/csrc -c cluster_attend.cu`
// compiles it alone (the plugin's device helpers, attention_device.cuh, come from there).
// The torch binding is cluster_attend_binding.cpp; the script builds both with
// torch.utils.cpp_extension.load (with -DCLUSTER_ATTEND_STAMPS for its phase
// timings).
//
// Semantics: those of the Triton store_attend kernel (kernels/store_attend.py), for
// fp16 / bf16, head_dim 64 or 128, and at most 8 (token, q head) rows per
// (request, kv head) group: store the step's K/V rows at loc (slots outside
// [1, num_slots) skipped; loc null: nothing stored, every key read from the cache),
// attend the step's queries over the paged cache (table lookup, causal, optional
// window, softcap, sinks), write out.
//
// Work split: one cluster of `splits` CTAs per (request, kv head) group; CTA `s` of
// the cluster attends split `s` of the group's KV range (the split rule of
// store_attend: whole 16-key steps). Each CTA folds its keys into an online-softmax
// partial in its shared memory; after a cluster barrier, CTA `s` merges, for its
// share of the (row, head-dim) outputs, the partials of every split in split order
// (reading its peers' shared memory) and writes them; a second barrier keeps every
// CTA's shared memory alive until its peers have read it. No global workspace, no
// atomics: the merge order is fixed, so the result does not depend on timing.
//
// With CLUSTER_ATTEND_STAMPS defined, thread 0 of every CTA records clock64() at nine
// points (entry; metadata read; table entries read and copies issued; K/V in shared
// memory; keys folded; CTA merged; first cluster barrier passed; outputs written; second
// barrier passed) into a device array that attnplug_cluster_attend_read_stamps copies out.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

// Element types (q, k, v, the caches and out share one).
enum AttnplugClusterDtype : int {
  CLUSTER_ATTEND_FLOAT16 = 1,
  CLUSTER_ATTEND_BFLOAT16 = 2,
};

extern "C" {

struct AttnplugClusterAttendArgs {
  const void* q;          // [T, H, D]; strides stride_qt, stride_qh (elements), last dim dense
  const void* k_new;      // [T, Hkv, D]; token stride stride_knt, dense [Hkv, D] rows
  const void* v_new;      // same layout, token stride stride_vnt
  const void* loc;        // [T] int32 / int64 slots, or null: nothing stored
  void* k_cache;          // [S, Hkv, D] contiguous
  void* v_cache;
  void* out;              // [T, H, D]; strides stride_ot, stride_oh
  const int32_t* cu_q_lens;  // [bs + 1]
  const void* seq_lens;      // [bs] int32 / int64: KV length including the new tokens
  const int32_t* table;      // [R, table_width], row stride stride_table
  const void* table_rows;    // [bs] int32 / int64
  const void* table_start;   // [bs] int32 / int64, or null: 0
  const float* sinks;        // [H] natural-log sink logits, or null
  int64_t stride_qt, stride_qh, stride_knt, stride_vnt, stride_ot, stride_oh, stride_table;
  int64_t num_slots;
  int32_t table_width, table_rows_len;
  int32_t num_reqs, num_kv_heads, group;  // group: q heads per kv head
  int32_t head_dim;
  int32_t rows;       // bound on (new tokens of a request) * group: 1..8
  int32_t window;     // 0: no window
  int32_t splits;     // CTAs per cluster: 1, 2, 4, 8 or 16
  float qk_scale;     // base-2 logits: qk * qk_scale (softcap: tanh(qk * qk_scale) * softcap_log2)
  float softcap_log2; // 0: no softcap
  int32_t dtype;      // AttnplugClusterDtype
  bool loc_is_int64, seq_lens_is_int64, table_rows_is_int64, table_start_is_int64;
  bool pdl;           // launch with Programmatic Dependent Launch
  bool prologue;      // read metadata, table entries and cached K/V before the wait
  bool release_early; // release dependents right after the wait
};

// Whether these arguments are served (dtype, head_dim, rows, splits, 16-byte alignment of
// every row): null when they are, else a static message naming the problem.
const char* attnplug_cluster_attend_unsupported(const AttnplugClusterAttendArgs* a);

// Enqueue the launch on `stream`; never syncs. Returns the first CUDA error met
// (unsupported arguments as cudaErrorInvalidValue, a device below compute capability
// 9.0 as cudaErrorNotSupported: clusters); *pdl_used (may be null) reports whether the
// launch used PDL.
cudaError_t attnplug_cluster_attend_launch(const AttnplugClusterAttendArgs* a, cudaStream_t stream,
                                           bool* pdl_used);

// The launch probe (cluster_attend.cu): groups x splits CTAs that do almost nothing, in
// clusters of `splits` CTAs with two cluster barriers (cluster) or plainly, with or
// without PDL.
cudaError_t attnplug_cluster_launch_probe(float* out, int groups, int splits, bool cluster, bool pdl,
                                          cudaStream_t stream);

#ifdef CLUSTER_ATTEND_STAMPS
// Most CTAs whose stamps are kept (CTA (split, group) at row group * splits + split).
#define CLUSTER_ATTEND_MAX_STAMPED_CTAS 8192
#define CLUSTER_ATTEND_STAMPS_PER_CTA 9
// Copy the first n stamps (int64 clock64 values, 9 per CTA) to host memory.
cudaError_t attnplug_cluster_attend_read_stamps(long long* host, int n);
#endif

}  // extern "C"
