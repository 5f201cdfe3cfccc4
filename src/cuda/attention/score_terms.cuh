// flash_attention's per-element score terms on CUDA: the element mask, the bias, the block-sparse tile map, the
// bias gradient's workspace, the gate (gate_terms.cuh) and the work counter, carried by one masking policy
// (FlashTermsMask) so that the plain policies (FlashMask, CompressedMask) compile to the kernels they are without
// them. A mask and bias without query rows and no tile map or work counter take FlashKeyTermsMask, whose kernels
// add one term per key (key terms, below) and carry none of the per-element code.
//
// Kernels see the terms through two things:
//  - Tile kinds (tile_walk.cuh): a kernel tile of queries [t0, t0 + rows) x keys [j0, j0 + keys) is absent (every
//    block tile it overlaps is absent: no loads, no MMAs), exists (every overlapped block tile exists and is
//    partial: the element mask is read), full (every one is full: the element mask is not read) or mixed (the
//    tile state is looked up per element). Without a tile map every kernel tile exists.
//  - Scores with terms (init_scores): per thread, the elements it holds in an accumulator fragment (two rows of a
//    16-row tile; per 8 columns, two adjacent columns; query rows x key columns in the forward and dQ kernels,
//    key rows x query columns in the dK/dV kernels) get bias / scale where kept and -inf where not, so that the
//    raw score becomes q.k + bias / scale (the kernels prescale by scale * log2 e in the softmax). Either the
//    score MMA accumulates q.k onto them (the mma.sync kernels and the wgmma dK/dV kernel, which write them before
//    the MMA), or they are added to q.k before the softmax or the recomputation of P (the wgmma forward and dQ,
//    whose consumers hold fewer registers there). Tiles that need no element reads keep the plain path.
//
// A backward kernel whose row has lse = -inf (no kept key) would form -inf - (-inf) in its exponent for a masked
// element: with terms the kernels read such an lse as +inf (finite_lse), so that every such P is 0.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/attention/gate_terms.cuh"
#include "cuda/attention/masking_policy.cuh"
#include "cuda/primitives/common.cuh"
#include "cuda/primitives/softmax.cuh"

namespace sparseattn::cuda::attention {

// A mask or a bias as flash_attention reads it: batched [B|1, Hq|Hkv|1, T|1, S], packed row form [Hm|1, Nq|1, Lk]
// or key form [Hm|1, Nk]. Broadcast dimensions have stride 0; the key dimension has stride 1.
struct BroadcastView {
  const void* data;  // null: absent
  i64 batch_stride;  // per batch row (seq.batch; packed sequences have batch 0)
  i64 head_stride;   // per head of the tensor
  i64 row_stride;    // per query row (seq.q_begin + t); 0 when shared by every query
  int head_div;      // the tensor's head of query head h is h / head_div
  bool packed_keys;  // key form: key s of a sequence is entry seq.k_begin + s of its row

  // Element offset of key 0 of query row t (of the sequence) of query head h.
  template <class Seq>
  __device__ __forceinline__ i64 row_offset(const Seq& seq, i64 h, i64 t) const {
    return seq.batch * batch_stride + i64{static_cast<int>(h) / head_div} * head_stride +
           (seq.q_begin + t) * row_stride + (packed_keys ? seq.k_begin : 0);
  }
};

// Block-sparse tile states [B|1, Hb|1, nQ, nK] (bool or uint8): 0 absent, 2 full (exists, the element mask is not
// read), any other value exists. Tiles are block_q queries x block_k keys from each sequence's first query and
// key; the batch index counts sequences. Tiles past nQ or nK are absent.
struct TileMap {
  const std::uint8_t* states;  // null: every tile exists
  i64 batch_stride, head_stride, row_stride;
  int head_div;
  i64 query_tiles, key_tiles;
  i64 block_q, block_k;

  // The states of query tile r of (sequence, query head): a row of key tiles (null when r is past the map).
  __device__ __forceinline__ const std::uint8_t* row(i64 sequence, i64 h, i64 r) const {
    if (r >= query_tiles) return nullptr;
    return states + sequence * batch_stride + i64{static_cast<int>(h) / head_div} * head_stride + r * row_stride;
  }
  __device__ __forceinline__ static std::uint8_t at(const std::uint8_t* row, i64 c, i64 key_tiles) {
    return row != nullptr && c < key_tiles ? row[c] : std::uint8_t{0};
  }
};

// Where the backward writes the bias gradient's fp32 contributions (reduced to dbias by reduce_bias_gradient):
//  - key sums (a bias shared by every query row): per (query head, key), the sum over the head's queries:
//    data[h * head_stride + seq.batch * batch_stride + seq.k_begin + key];
//  - rows: per (query row, key) of head h / head_div, added up over the heads of a group by the one thread that
//    holds the element in every step: data[seq.batch * batch_stride + (h / head_div) * head_stride +
//    (seq.q_begin + t) * row_stride + key].
struct BiasGradientSink {
  float* data;  // null: no bias gradient
  bool key_sums;
  i64 head_stride, batch_stride, row_stride;
  int head_div;
};

// flash_attention's sparse-softmax threshold in the forward (docs/semantics.md section 8), decided in the forward
// kernel's own tiles (the API requires threshold_block to be them): the key tiles of a query tile are visited in
// order and one is skipped (no softmax update, no P V) when, for every row of the query tile with a visible key in
// it, the row's largest logit is below its running maximum over the kept tiles + log(tau_row). The kernel records
// each kept pair in `decisions` (1; the host clears the map before the launch, so skipped and unvisited pairs
// read 0), which the backward takes as its tile map.
struct SoftmaxThreshold {
  std::uint8_t* decisions;  // null: no threshold. [B, Hq, query_tiles, key_tiles], contiguous uint8
  i64 heads, query_tiles, key_tiles;
  float log2_tau;  // log2(tau); causal rows add log2((a + 1) / S)
};

struct ScoreTerms {
  BroadcastView mask, bias;
  TileMap tiles;
  SoftmaxThreshold threshold;  // forward only
  BiasGradientSink dbias;
  GateTerms gate;  // gated attention (gate_terms.cuh); gate.alpha.data null without it
  // Test diagnostics: when given, each CTA adds the query x key elements of the kernel tiles it computed (one
  // atomicAdd per CTA).
  unsigned long long* work_counter;
  float inv_scale;   // 1 / softmax scale: the bias enters the raw scores as bias / scale
  bool rows_shared;  // neither the mask nor the bias depends on the query row
};

// flash_attention with mask, bias, tile map, bias gradient or work counter: FlashMask's bounds plus ScoreTerms.
struct FlashTermsMask : FlashMask {
  struct Config : FlashMask::Config {
    ScoreTerms terms;
  };
  __device__ __forceinline__ FlashTermsMask(const Config& config, i64 T_, i64 S_) : FlashMask{config, T_, S_} {}
};

// FlashTermsMask for calls with per-head windows (int32 [Hq] bounds, masking_policy.cuh): the same kernels, whose
// CTAs bind the bounds of their query head (for_head) and walk each head's query range in dK/dV. A separate policy,
// so that FlashTermsMask's kernels carry none of the per-head code and registers.
struct FlashTermsHeadMask : FlashTermsMask {
  struct Config : FlashTermsMask::Config {
    HeadBounds head_left, head_right;  // null where that side's bound is the scalar one
  };
  static constexpr bool kHeadWindows = true;
  HeadBounds head_left, head_right;
  __device__ __forceinline__ FlashTermsHeadMask(const Config& config, i64 T_, i64 S_)
      : FlashTermsMask{config, T_, S_}, head_left{config.head_left}, head_right{config.head_right} {}
};

template <class Mask>
inline constexpr bool kHasTerms = std::is_same_v<Mask, FlashTermsMask> || std::is_same_v<Mask, FlashTermsHeadMask>;

// log2(tau_row) of query row t of the policy's sequence: log2(tau), plus log2((a + 1) / S) when causal (a = t + S -
// T the aligned position); -inf where a + 1 <= 0 (such a row sees no key: it sets no condition).
__device__ __forceinline__ float threshold_log2_tau(const SoftmaxThreshold& threshold, const FlashTermsMask& mask,
                                                    i64 t) {
  if (!mask.c.causal) return threshold.log2_tau;
  const i64 position = t + mask.S - mask.T + 1;
  if (position <= 0) return -INFINITY;
  return threshold.log2_tau + log2f(static_cast<float>(position) / static_cast<float>(mask.S));
}

// log2(tau_row) of the thread's two rows of the 16-row tile at query row0 (accumulator layout, softmax.cuh).
__device__ __forceinline__ void threshold_rows(const SoftmaxThreshold& threshold, const FlashTermsMask& mask, i64 row0,
                                               float (&log2_tau)[2]) {
  const int lane = threadIdx.x % 32;
  log2_tau[0] = threshold_log2_tau(threshold, mask, row0 + lane / 4);
  log2_tau[1] = threshold_log2_tau(threshold, mask, row0 + lane / 4 + 8);
}

// Records that the forward kept key tile key_tile for query tile query_tile of (sequence, query head h).
__device__ __forceinline__ void record_kept_tile(const SoftmaxThreshold& threshold, i64 sequence, i64 h,
                                                 i64 query_tile, i64 key_tile) {
  if (query_tile >= threshold.query_tiles || key_tile >= threshold.key_tiles) return;
  threshold.decisions[((sequence * threshold.heads + h) * threshold.query_tiles + query_tile) * threshold.key_tiles +
                      key_tile] = 1;
}

// flash_attention whose mask and bias depend on the key alone (rows_shared: a key bias, a key mask), without a tile
// map or work counter: FlashMask's bounds plus ScoreTerms, whose kernels take every tile's terms by key (key terms
// below) and carry none of the per-element reads, the tile walk or their registers. The bias gradient is a key sum.
struct FlashKeyTermsMask : FlashMask {
  struct Config : FlashMask::Config {
    ScoreTerms terms;
  };
  __device__ __forceinline__ FlashKeyTermsMask(const Config& config, i64 T_, i64 S_) : FlashMask{config, T_, S_} {}
};

template <class Mask>
inline constexpr bool kHasKeyTerms = std::is_same_v<Mask, FlashKeyTermsMask>;
// The policies with ScoreTerms (mc.terms).
template <class Mask>
inline constexpr bool kHasAnyTerms = kHasTerms<Mask> || kHasKeyTerms<Mask>;

// flash_attention with a gate and none of the other terms (no mask, bias, tile map, bias gradient or work counter):
// FlashMask's bounds plus the gate alone, so that its kernels carry none of the terms' per-element code and
// registers.
struct FlashGateMask : FlashMask {
  struct Config : FlashMask::Config {
    GateTerms gate;
  };
  __device__ __forceinline__ FlashGateMask(const Config& config, i64 T_, i64 S_) : FlashMask{config, T_, S_} {}
};

// The policies that may carry a gate, and their gate.
template <class Mask>
inline constexpr bool kHasGate = kHasAnyTerms<Mask> || std::is_same_v<Mask, FlashGateMask>;

template <class Mask>
__device__ __forceinline__ const GateTerms& gate_of(const typename Mask::Config& mc) {
  if constexpr (kHasAnyTerms<Mask>) {
    return mc.terms.gate;
  } else {
    return mc.gate;
  }
}

// Calls body with the gate kind (gate_terms.cuh's with_gate) of a call: kNoGate for the policies without a gate.
template <class Mask, class Body>
__device__ __forceinline__ void with_gate_of(const typename Mask::Config& mc, Body&& body) {
  if constexpr (kHasGate<Mask>) {
    with_gate(gate_of<Mask>(mc), body);
  } else {
    body(std::integral_constant<int, kNoGate>{});
  }
}

// A query-row kernel's staging of the gate delta of keys [j0, j0 + kN) into dst (stage_gate_keys) by thread
// `index` of `count`; nothing without a gate.
template <class T, int kN, class Mask, class Seq>
__device__ __forceinline__ void stage_query_gate(float* dst, const typename Mask::Config& mc, const Seq& seq, i64 j0,
                                                 i64 hk, int index, int count) {
  if constexpr (kHasGate<Mask>) {
    if (gate_of<Mask>(mc).on()) stage_gate_keys<T, kN>(dst, gate_of<Mask>(mc), seq, j0, hk, index, count);
  }
}

enum TileKind : int { kTileAbsent = 0, kTileExists = 1, kTileFull = 2, kTileMixed = 3 };

// Whether a tile of this kind needs the per-element kept bits (the element mask or the tile states).
__device__ __forceinline__ bool tile_needs_keep(const ScoreTerms& terms, int kind) {
  return kind == kTileMixed || (kind == kTileExists && terms.mask.data != nullptr);
}
// Whether a tile of this kind reads anything per element.
__device__ __forceinline__ bool tile_needs_terms(const ScoreTerms& terms, int kind) {
  return terms.bias.data != nullptr || tile_needs_keep(terms, kind);
}

__device__ __forceinline__ void add_work(const ScoreTerms& terms, unsigned long long work) {
  if (terms.work_counter != nullptr && work > 0) atomicAdd(terms.work_counter, work);
}

// A bias value (of q's dtype T) from its 16-bit pattern.
template <class T>
__device__ __forceinline__ float bias_value(std::uint32_t bits) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(bits << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
}

// Initialises a thread's scores s, an accumulator fragment [16 x kCols] that the score MMA then accumulates q.k
// onto, with the terms: bias / scale where the element is kept, -inf where it is not (-inf + q.k stays -inf), 0
// past the sequence (T or S; the kernels' bounds mask those, and their mask and bias are not read); with kAdd,
// adds them to the q.k that s holds (elements past the sequence keep theirs). Element (n, i)
// is row row0 + lane / 4 + 8 (i / 2), column col0 + 8 n + 2 (lane % 4) + i % 2. kQueryRows: rows are queries and
// columns keys (forward, dQ); otherwise rows are keys and columns queries (dK/dV). kind: the tile's
// (tile_walk.cuh). Terms shared by every query row (rows_shared) in a tile that is not mixed are read once per
// key.
template <class T, int kCols, bool kQueryRows, bool kAdd = false, class Seq>
__device__ __forceinline__ void init_scores(float (&s)[kCols / 8][4], const ScoreTerms& terms, const Seq& seq,
                                            i64 sequence, i64 h, i64 row0, i64 col0, int kind) {
  auto put = [&](float& dst, float x, bool inside) {
    if constexpr (kAdd) {
      if (inside) dst += x;
    } else {
      dst = inside ? x : 0.f;
    }
  };
  const int lane = threadIdx.x % 32;
  const bool read_mask = terms.mask.data != nullptr && kind != kTileFull;
  const bool has_bias = terms.bias.data != nullptr;
  const bool mixed = kind == kTileMixed;
  const bool shared = terms.rows_shared && !mixed;
  const TileMap& map = terms.tiles;
  const float inv_scale = terms.inv_scale;
  // Positions inside a sequence stay below 2^31 (the API bounds sequence lengths).
  const int T_len = static_cast<int>(seq.T), S_len = static_cast<int>(seq.S);
  const int col_first = static_cast<int>(col0) + 2 * (lane % 4);
  // Query row t's mask and bias rows (key 0 of the sequence at index 0).
  auto mask_row = [&](int t) {
    return static_cast<const std::uint8_t*>(terms.mask.data) + terms.mask.row_offset(seq, h, t);
  };
  auto bias_row = [&](int t) {
    return static_cast<const std::uint16_t*>(terms.bias.data) + terms.bias.row_offset(seq, h, t);
  };
  // The term of an element inside the sequence from its mask and bias entries and its tile state.
  auto term = [&](const std::uint8_t* mask, const std::uint16_t* bias, int state) {
    if (state == 0 || (read_mask && state != 2 && *mask == 0)) return -INFINITY;
    return has_bias ? bias_value<T>(*bias) * inv_scale : 0.f;
  };
  const int uniform = kind == kTileFull ? 2 : 1;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = static_cast<int>(row0) + lane / 4 + 8 * half;
    if constexpr (kQueryRows) {
      if (!kAdd && half == 1 && shared) {  // the terms of row 0, whatever row 1 is
#pragma unroll
        for (int n = 0; n < kCols / 8; ++n) s[n][2] = s[n][0], s[n][3] = s[n][1];
        continue;
      }
      // Row 0 stands for every row where the terms are shared (row 0 lies inside the sequence).
      const bool row_in = shared || r < T_len;
      const int t = shared ? 0 : r;
      const std::uint8_t* mask = read_mask && row_in ? mask_row(t) : nullptr;
      const std::uint16_t* bias = has_bias && row_in ? bias_row(t) : nullptr;
      const std::uint8_t* states = mixed && row_in ? map.row(sequence, h, t / map.block_q) : nullptr;
      const int block_k = static_cast<int>(min(map.block_k, i64{1} << 30));
#pragma unroll
      for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int key = col_first + 8 * n + j;
          const bool inside = row_in && key < S_len;
          float x = 0.f;
          if (inside) {
            const int state = mixed ? TileMap::at(states, key / block_k, map.key_tiles) : uniform;
            x = term(mask + key, bias + key, state);
          }
          put(s[n][2 * half + j], x, inside);
        }
      }
    } else {
      const bool row_in = r < S_len;
      if (shared) {  // one term for the whole key row
        const float x = row_in ? term(read_mask ? mask_row(0) + r : nullptr, has_bias ? bias_row(0) + r : nullptr,
                                      uniform)
                               : 0.f;
#pragma unroll
        for (int n = 0; n < kCols / 8; ++n) put(s[n][2 * half], x, true), put(s[n][2 * half + 1], x, true);
        continue;
      }
      const i64 key_tile = mixed ? r / map.block_k : 0;
#pragma unroll
      for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int t = col_first + 8 * n + j;
          const bool inside = row_in && t < T_len;
          float x = 0.f;
          if (inside) {
            const int state =
                mixed ? TileMap::at(map.row(sequence, h, t / map.block_q), key_tile, map.key_tiles) : uniform;
            x = term(read_mask ? mask_row(t) + r : nullptr, has_bias ? bias_row(t) + r : nullptr, state);
          }
          put(s[n][2 * half + j], x, inside);
        }
      }
    }
  }
}

// Key terms: where neither the mask nor the bias depends on the query row (rows_shared: a key bias, a key mask) and
// the tile is not mixed, every row of a kernel tile adds the same term per key. The kernels then take one term per
// key instead of reading the mask and bias per element: a query-row kernel stages the terms of a key tile in
// shared memory (one global read per key, stage_key_terms or a consumer thread per key) and adds each thread's
// columns from there (add_key_terms); a dK/dV kernel, whose threads hold fixed key rows, keeps its two rows' terms
// in registers.
__device__ __forceinline__ bool tile_uses_key_terms(const ScoreTerms& terms, int kind) {
  return terms.rows_shared && kind != kTileMixed;
}

// The term of key `key` (of the sequence) for query head h in a tile of this kind (rows shared, not mixed): bias /
// scale where the key is kept, -inf where the mask drops it, 0 past the sequence.
template <class T, class Seq>
__device__ __forceinline__ float key_term(const ScoreTerms& terms, const Seq& seq, i64 h, i64 key, int kind) {
  if (key >= seq.S) return 0.f;
  if (terms.mask.data != nullptr && kind != kTileFull &&
      static_cast<const std::uint8_t*>(terms.mask.data)[terms.mask.row_offset(seq, h, 0) + key] == 0) {
    return -INFINITY;
  }
  if (terms.bias.data == nullptr) return 0.f;
  const std::uint16_t bits = static_cast<const std::uint16_t*>(terms.bias.data)[terms.bias.row_offset(seq, h, 0) + key];
  return bias_value<T>(bits) * terms.inv_scale;
}

// Thread `index` of `count` writes its share of the key terms of keys [j0, j0 + kN) (query head h, a tile of this
// kind) into dst[kN]; a barrier of the `count` threads must follow before the entries are read.
template <class T, int kN, class Seq>
__device__ __forceinline__ void stage_key_terms(float* dst, const ScoreTerms& terms, const Seq& seq, i64 h, i64 j0,
                                                int kind, int index, int count) {
  for (int i = index; i < kN; i += count) dst[i] = key_term<T>(terms, seq, h, j0 + i, kind);
}

// A query-row thread's scores s [kCols / 8][4] (columns: keys; key_terms[c]: the term of column c of the tile) gain
// their columns' terms (kAdd, onto q.k) or start from them (before the score MMA accumulates q.k onto them).
template <int kCols, bool kAdd>
__device__ __forceinline__ void add_key_terms(float (&s)[kCols / 8][4], const float* key_terms) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
    const float2 x = *reinterpret_cast<const float2*>(key_terms + n * 8 + 2 * (lane % 4));
    if constexpr (kAdd) {
      s[n][0] += x.x, s[n][1] += x.y, s[n][2] += x.x, s[n][3] += x.y;
    } else {
      s[n][0] = x.x, s[n][1] = x.y, s[n][2] = x.x, s[n][3] = x.y;
    }
  }
}

// An mma.sync query-row kernel's staging of the key terms of keys [j0, j0 + kN) (query head h) into dst by thread
// `index` of `count` (stage_key_terms) under FlashKeyTermsMask; nothing for the other policies (FlashTermsMask's
// mma.sync kernels read their terms per element, init_scores, which keeps their registers as they are).
template <class T, int kN, class Mask, class Seq>
__device__ __forceinline__ void stage_query_key_terms(float* dst, const typename Mask::Config& mc, const Seq& seq,
                                                      i64 h, i64 j0, int index, int count) {
  if constexpr (kHasKeyTerms<Mask>) stage_key_terms<T, kN>(dst, mc.terms, seq, h, j0, kTileExists, index, count);
}

// An lse of -inf (a row without a kept key) read as +inf by the backward with terms: exp2(s - lse) is then 0 for a
// masked element's s = -inf instead of NaN.
__device__ __forceinline__ float finite_lse(float lse) { return lse == -INFINITY ? INFINITY : lse; }

// Key sums of a dK/dV thread: adds each of its two key rows' elements of ds [kCols / 8][4] (dS^T) to sums[half].
template <int kCols>
__device__ __forceinline__ void add_key_sums(const float (&ds)[kCols / 8][4], float (&sums)[2]) {
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
    sums[0] += ds[n][0] + ds[n][1];
    sums[1] += ds[n][2] + ds[n][3];
  }
}

// The bias gradient of a dK/dV thread: ds [kCols / 8][4] holds dS^T (its two key rows key0 + lane / 4 + 8 half
// against queries t0 + 8 n + 2 (lane % 4) + j) of query head h.
//  - key sums: adds each row's elements to sums[half] (flush_key_sums writes them once per head);
//  - rows: adds every element to its workspace entry.
template <int kCols, class Seq>
__device__ __forceinline__ void add_bias_gradient(const BiasGradientSink& sink, const float (&ds)[kCols / 8][4],
                                                  float (&sums)[2], const Seq& seq, i64 h, i64 key0, i64 t0) {
  if (sink.key_sums) {
    add_key_sums<kCols>(ds, sums);
    return;
  }
  const int lane = threadIdx.x % 32;
  const i64 base = seq.batch * sink.batch_stride + i64{static_cast<int>(h) / sink.head_div} * sink.head_stride;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const i64 key = key0 + lane / 4 + 8 * half;
    if (key >= seq.S) continue;
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const i64 t = t0 + 8 * n + 2 * (lane % 4) + j;
        if (t < seq.T) sink.data[base + (seq.q_begin + t) * sink.row_stride + key] += ds[n][2 * half + j];
      }
    }
  }
}

// Key sums: the quad's total of each of the thread's two key rows for query head h, written once, then reset.
template <class Seq>
__device__ __forceinline__ void flush_key_sums(const BiasGradientSink& sink, float (&sums)[2], const Seq& seq, i64 h,
                                               i64 key0) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float total = quad_sum(sums[half]);
    sums[half] = 0.f;
    const i64 key = key0 + lane / 4 + 8 * half;
    if (lane % 4 == 0 && key < seq.S) {
      sink.data[h * sink.head_stride + seq.batch * sink.batch_stride + seq.k_begin + key] = total;
    }
  }
}

}  // namespace sparseattn::cuda::attention
