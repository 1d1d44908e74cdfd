// attnplug CUDA plugin: what a CTA of the one-launch attention kernels (staged_attend.cu,
// resident_attend.cu) knows of its (request, kv head) group from the step's metadata, the
// table lookup of a key position, the phase stamps, and their launch. Free of torch headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention_device.cuh"
#include "staged_attend.h"

namespace attnplug_dev {

constexpr int kRows = 16;  // most (token, q head) rows of a group: one MMA tile

// Thread 0 of the CTA records %globaltimer as phase `i` (a.trace set).
__device__ __forceinline__ void stamp(const AttnplugStagedAttendArgs& a, int i) {
  if (a.trace != nullptr && threadIdx.x == 0) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    a.trace[(static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * 8 + i] = static_cast<int64_t>(t);
  }
}

// What a CTA knows of its group from the step's metadata.
struct Share {
  int64_t q_start;
  int q_len;
  int n_rows;
  int new0;        // position of the step's first token
  int s_lo, s_hi;  // this CTA's key positions
  int t_start;
  const int32_t* t_row;
};

__device__ __forceinline__ Share share_of(const AttnplugStagedAttendArgs& a, int b, int split) {
  Share s;
  s.q_start = a.cu_q_lens[b];
  s.q_len = a.cu_q_lens[b + 1] - static_cast<int>(s.q_start);
  const int seq_len = static_cast<int>(load_index(a.seq_lens, b, a.seq_lens_is_int64));
  int64_t t_idx = load_index(a.table_rows, b, a.table_rows_is_int64);
  s.t_start = a.table_start != nullptr ? static_cast<int>(load_index(a.table_start, b, a.table_start_is_int64)) : 0;
  s.new0 = seq_len - s.q_len;
  s.n_rows = min(max(s.q_len, 0) * a.group, kRows);
  // the group's key range: the first token's window start .. the last token's position
  const int kv_lo = a.window > 0 ? max(s.new0 - a.window + 1, 0) : 0;
  const int kv_hi = max(s.q_len > 0 ? seq_len : kv_lo, kv_lo);
  split_share(kv_lo, kv_hi, a.splits, split, &s.s_lo, &s.s_hi);
  if (t_idx < 0 || t_idx >= a.table_rows_len) {
    t_idx = 0;  // outside the table: row 0
  }
  s.t_row = a.table + t_idx * a.stride_table;
  return s;
}

// The slot of key position j, or 0 when j holds no key of this CTA.
__device__ __forceinline__ int64_t slot_of(const AttnplugStagedAttendArgs& a, const Share& s, int j) {
  const int col = j - s.t_start;
  if (j < s.s_lo || j >= s.s_hi || col < 0 || col >= a.table_width) {
    return 0;
  }
  const int64_t slot = s.t_row[col];
  return (slot >= 1 && slot < a.num_slots) ? slot : 0;
}

// Per device, for one kernel instantiation: its binary's compute capability (x10) and the
// dynamic shared memory limit raised so far; filled on first use.
constexpr int kMaxDevices = 64;
struct LaunchState {
  int version[kMaxDevices] = {};
  int smem_set[kMaxDevices] = {};
};

// Enqueue a one-launch attention kernel on `stream` (`grid`, `threads`, `smem` dynamic bytes),
// with Programmatic Dependent Launch when `a.pdl` asks and the kernel's image holds the
// grid-dependency wait (sm_90+; the args' PDL flags are cleared otherwise). Never syncs;
// returns the first CUDA error met (a failed launch's error is cleared); *pdl_used (may be
// null) says whether PDL was used.
template <typename Kernel>
inline cudaError_t launch_attend(Kernel kernel, LaunchState* state, dim3 grid, int threads, size_t smem,
                                 const AttnplugStagedAttendArgs& a, cudaStream_t stream, bool* pdl_used) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (state->version[device] == 0) {
    cudaFuncAttributes attr = {};
    err = cudaFuncGetAttributes(&attr, kernel);
    if (err != cudaSuccess) return err;
    state->version[device] = attr.binaryVersion;
  }
  if (state->smem_set[device] < static_cast<int>(smem)) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    state->smem_set[device] = static_cast<int>(smem);
  }
  // Only an sm_90+ image holds the grid-dependency wait; launching an older image with the
  // attribute would let it read before its producer is done.
  const bool use_pdl = a.pdl && state->version[device] >= 90;
  AttnplugStagedAttendArgs args = a;
  args.pdl = use_pdl;
  args.prologue = use_pdl && a.prologue;
  args.release_early = use_pdl && a.release_early;
  cudaLaunchAttribute attrs[1];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(static_cast<unsigned int>(threads), 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = use_pdl ? attrs : nullptr;
  cfg.numAttrs = use_pdl ? 1 : 0;
  err = cudaLaunchKernelEx(&cfg, kernel, args);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the non-sticky launch error
    return err;
  }
  if (pdl_used != nullptr) {
    *pdl_used = use_pdl;
  }
  return cudaSuccess;
}

}  // namespace attnplug_dev
