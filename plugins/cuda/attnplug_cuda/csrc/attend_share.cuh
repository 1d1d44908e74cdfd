// attnplug CUDA plugin: what a CTA of the one-launch attention kernels (staged_attend.cu,
// resident_attend.cu) knows of its (request, kv head) group from the step's metadata, the
// table lookup of a key position, and the phase stamps. Free of torch headers.
#pragma once

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

}  // namespace attnplug_dev
