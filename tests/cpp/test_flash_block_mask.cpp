// flash_attention's block-sparse masks (dense tile mask, FlexAttention-style lists with full tiles) and
// per-head windows on the CPU reference: cases from docs/semantics.md section 8 against a naive attention
// with the expanded element mask, gradients, validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <vector>

#include "attention_testing.h"
#include "flash_case.h"
#include "sparseattn/flash_attention.h"

namespace sparseattn::test {
namespace {

using Keep = std::function<bool(std::int64_t, std::int64_t, std::int64_t, std::int64_t)>;

// flash_case.h's call with random inputs and a random bias [B, Hq, T, S] that use_bias() passes.
struct Call : FlashCase {
  HostF64 bias_values;

  Call(std::int64_t b, std::int64_t t, std::int64_t s, std::int64_t hq, std::int64_t hkv, std::int64_t d,
       std::int64_t dv_, std::uint64_t seed)
      : FlashCase({b, t, s, hq, hkv, d, dv_}), bias_values({b, hq, t, s}) {
    std::mt19937_64 rng(seed);
    for (HostF64* x : {&q, &k, &v, &d_o, &bias_values}) fill_random(*x, rng);
  }
  void use_bias() {
    bias = dbias = bias_values;
    std::fill(dbias.data.begin(), dbias.data.end(), 0.0);
  }
  bool causal_keep(std::int64_t t, std::int64_t s) const { return !causal || s <= t + n.k_len - n.q_len; }
  NaiveAttention naive(const Keep& keep) const {
    const Keep all = [&](auto b, auto h, auto t, auto s) { return causal_keep(t, s) && keep(b, h, t, s); };
    return naive_attention(q, k, v, 1.0 / std::sqrt(double(n.dim)), all, [&](auto b, auto h, auto t, auto s) {
      return bias.data.empty() ? 0.0 : bias.data[((b * n.q_heads + h) * n.q_len + t) * n.k_len + s];
    });
  }
};

// The worked example's tile mask (docs/semantics.md, "Block-sparse masks"): T = S = 10, 4 x 4 tiles.
const int kTiles[3][3] = {{1, 0, 0}, {1, 1, 0}, {0, 1, 1}};

struct Lists {
  Host<std::int32_t> counts{{1, 1, 3}}, indices{{1, 1, 3, 3}, -7};  // -7: ignored entries past the count
  Lists() {
    counts.data = {1, 2, 2};
    const int rows[3][2] = {{0, -7}, {0, 1}, {1, 2}};
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 2; ++j) indices.data[i * 3 + j] = rows[i][j];
    }
  }
};

TEST(FlashBlockMask, ListsAndDenseTileMaskEqualTheExpandedElementMask) {
  for (bool causal : {true, false}) {
    Call lists_call(2, 10, 10, 2, 1, 8, 4, 1), dense_call(2, 10, 10, 2, 1, 8, 4, 1), element(2, 10, 10, 2, 1, 8, 4, 1);
    Lists lists;
    Host<std::uint8_t> tile_mask({1, 1, 3, 3});
    for (int i = 0; i < 9; ++i) tile_mask.data[i] = static_cast<std::uint8_t>(kTiles[i / 3][i % 3]);
    element.mask = Host<std::uint8_t>({1, 1, 10, 10});
    for (int t = 0; t < 10; ++t) {
      for (int s = 0; s < 10; ++s) element.mask.data[t * 10 + s] = static_cast<std::uint8_t>(kTiles[t / 4][s / 4]);
    }
    for (Call* c : {&lists_call, &dense_call, &element}) c->causal = causal, c->use_bias();
    lists_call.blocks.kv_num_blocks = lists.counts.view();
    lists_call.blocks.kv_indices = lists.indices.view();
    dense_call.blocks.block_mask = tile_mask.view();
    for (Call* c : {&lists_call, &dense_call}) c->blocks.block_q = 4, c->blocks.block_k = 4;
    for (Call* c : {&lists_call, &dense_call, &element}) c->forward(), c->backward();
    const NaiveAttention naive = element.naive([](auto, auto, auto t, auto s) { return kTiles[t / 4][s / 4] == 1; });
    for (Call* c : {&lists_call, &dense_call}) {
      expect_near(c->o.data, naive.o, 1e-12, "o");
      expect_near(c->lse.data, naive.lse, 1e-12, "lse");
      expect_near(c->o.data, element.o.data, 1e-13, "o vs element mask");
      expect_near(c->dq.data, element.dq.data, 1e-12, "dq");
      expect_near(c->dk.data, element.dk.data, 1e-12, "dk");
      expect_near(c->dv.data, element.dv.data, 1e-12, "dv");
      expect_near(c->dbias.data, element.dbias.data, 1e-12, "dbias");
    }
    if (causal) {  // query 0 keeps key 0, query 5 keys 0..5, query 9 keys 4..9 (the spec's worked example)
      EXPECT_NEAR(lists_call.o.data[0], lists_call.v.data[0], 1e-14);
    }
  }
}

TEST(FlashBlockMask, AbsentTilesGiveZeroRowsAndNoGradient) {
  // Query tile 1 (rows 2, 3) has no tile at all; query tile 0 only key tile 1.
  Call c(1, 4, 6, 2, 2, 4, 3, 2);
  c.use_bias();
  Host<std::int32_t> counts({1, 1, 2}), indices({1, 1, 2, 3}, 0);
  counts.data = {1, 0};
  indices.data[0] = 1;
  c.blocks.kv_num_blocks = counts.view(), c.blocks.kv_indices = indices.view();
  c.blocks.block_q = 2, c.blocks.block_k = 3;
  c.forward();
  c.backward();
  const NaiveAttention naive = c.naive([](auto, auto, auto t, auto s) { return t < 2 && s >= 3; });
  expect_near(c.o.data, naive.o, 1e-12, "o");
  expect_near(c.lse.data, naive.lse, 0, "lse");
  for (std::int64_t h = 0; h < 2; ++h) {
    for (std::int64_t t = 0; t < 4; ++t) {
      for (std::int64_t s = 0; s < 6; ++s) {
        const double d = c.dbias.data[(h * 4 + t) * 6 + s];
        if (t >= 2 || s < 3) EXPECT_EQ(d, 0.0) << h << " " << t << " " << s;
      }
      if (t >= 2) {
        EXPECT_EQ(c.lse.data[h * 4 + t], -kInf);
        for (std::int64_t d = 0; d < 4; ++d) EXPECT_EQ(c.dq.data[(t * 2 + h) * 4 + d], 0.0);
      }
    }
  }
  for (std::int64_t s = 0; s < 3; ++s) {  // keys 0..2 are in no existing tile
    for (std::int64_t i = 0; i < 2 * 4; ++i) EXPECT_EQ(c.dk.data[s * 8 + i], 0.0);
    for (std::int64_t i = 0; i < 2 * 3; ++i) EXPECT_EQ(c.dv.data[s * 6 + i], 0.0);
  }
}

TEST(FlashBlockMask, FullTilesDoNotReadTheElementMask) {
  // 1 x 2 tiles of 4 keys; the element mask hides keys 1 and 6. Tile 0 listed as full (its False kept as
  // True: the caller's claim wins), tile 1 as partial (key 6 hidden).
  Call c(1, 3, 8, 1, 1, 4, 2, 3), partial_only(1, 3, 8, 1, 1, 4, 2, 3);
  for (Call* x : {&c, &partial_only}) {
    x->mask = Host<std::uint8_t>({1, 1, 1, 8}, 1);
    x->mask.data[1] = 0, x->mask.data[6] = 0;
  }
  Host<std::int32_t> counts({1, 1, 1}, 1), indices({1, 1, 1, 2}, 1), full_counts({1, 1, 1}, 1),
      full_indices({1, 1, 1, 1}, 0), both_counts({1, 1, 1}, 2), both_indices({1, 1, 1, 2}, 0);
  both_indices.data[1] = 1;
  c.blocks.kv_num_blocks = counts.view(), c.blocks.kv_indices = indices.view();
  c.blocks.full_kv_num_blocks = full_counts.view(), c.blocks.full_kv_indices = full_indices.view();
  partial_only.blocks.kv_num_blocks = both_counts.view(), partial_only.blocks.kv_indices = both_indices.view();
  for (Call* x : {&c, &partial_only}) {
    x->blocks.block_q = 4, x->blocks.block_k = 4;
    x->forward();
    x->backward();
  }
  expect_near(c.o.data, c.naive([](auto, auto, auto, auto s) { return s != 6; }).o, 1e-12, "full tile 0");
  expect_near(partial_only.o.data, c.naive([](auto, auto, auto, auto s) { return s != 1 && s != 6; }).o, 1e-12,
              "partial tiles");
  // Only full tiles, no partial list: the mask is never read.
  Call only_full(1, 3, 8, 1, 1, 4, 2, 3);
  only_full.mask = c.mask;
  only_full.blocks.full_kv_num_blocks = both_counts.view(), only_full.blocks.full_kv_indices = both_indices.view();
  only_full.blocks.block_q = 4, only_full.blocks.block_k = 4;
  only_full.forward();
  expect_near(only_full.o.data, c.naive([](auto, auto, auto, auto) { return true; }).o, 1e-12, "only full tiles");
}

TEST(FlashBlockMask, PerHeadTileMasksWithGqaAndDecodeShapes) {
  // Hq = 4, Hkv = 2, Tq = 3 against Tk = 11 (bottom-right causal), tile mask per query head [1, 4, 1, 3].
  Call c(2, 3, 11, 4, 2, 5, 3, 4), by_kv(2, 3, 11, 4, 2, 5, 3, 4);
  c.causal = by_kv.causal = true;
  Host<std::uint8_t> tiles({1, 4, 1, 3}), kv_tiles({2, 2, 1, 3});
  std::mt19937_64 rng(9);
  for (auto& x : tiles.data) x = static_cast<std::uint8_t>(rng() % 2);
  for (auto& x : kv_tiles.data) x = static_cast<std::uint8_t>(rng() % 2);
  c.blocks.block_mask = tiles.view(), by_kv.blocks.block_mask = kv_tiles.view();
  c.blocks.block_q = by_kv.blocks.block_q = 4;
  c.blocks.block_k = by_kv.blocks.block_k = 4;
  c.forward(), by_kv.forward();
  expect_near(c.o.data, c.naive([&](auto, auto h, auto, auto s) { return tiles.data[h * 3 + s / 4] == 1; }).o, 1e-12,
              "heads Hq");
  expect_near(by_kv.o.data,
              by_kv.naive([&](auto b, auto h, auto, auto s) { return kv_tiles.data[(b * 2 + h / 2) * 3 + s / 4] == 1; }).o,
              1e-12, "heads Hkv, batch B");
}

TEST(FlashBlockMask, PackedTilesStartAtEachSequence) {
  // cu_seqlens_q = [0, 5, 12], cu_seqlens_k = [0, 6, 13], bq = 4, bk = 3: sequence 1's query tiles are rows
  // 5..8 and 9..11. Compared with each sequence run batched alone.
  const std::int32_t cu_q_values[3] = {0, 5, 12}, cu_k_values[3] = {0, 6, 13};
  Host<std::int32_t> cu_q({3}), cu_k({3});
  for (int i = 0; i < 3; ++i) cu_q.data[i] = cu_q_values[i], cu_k.data[i] = cu_k_values[i];
  Host<std::uint8_t> tiles({2, 1, 2, 3}, 0);
  std::mt19937_64 rng(5);
  for (auto& x : tiles.data) x = static_cast<std::uint8_t>(rng() % 3 != 0);
  HostF64 q({12, 2, 4}), k({13, 1, 4}), v({13, 1, 2}), o({12, 2, 2}), lse({2, 12});
  for (HostF64* x : {&q, &k, &v}) fill_random(*x, rng);
  FlashAttentionParams p;
  p.q = q.view(), p.k = k.view(), p.v = v.view(), p.o = o.view(), p.lse = lse.view();
  p.seqs_q.cu_seqlens = cu_q.view(), p.seqs_k.cu_seqlens = cu_k.view();
  p.causal = true;
  p.blocks.block_mask = tiles.view(), p.blocks.block_q = 4, p.blocks.block_k = 3;
  flash_attention(p);
  for (int seq = 0; seq < 2; ++seq) {
    const std::int64_t t_len = cu_q.data[seq + 1] - cu_q.data[seq], s_len = cu_k.data[seq + 1] - cu_k.data[seq];
    Call one(1, t_len, s_len, 2, 1, 4, 2, 0);
    one.causal = true;
    for (std::int64_t t = 0; t < t_len * 2 * 4; ++t) one.q.data[t] = q.data[cu_q.data[seq] * 8 + t];
    for (std::int64_t s = 0; s < s_len * 4; ++s) one.k.data[s] = k.data[cu_k.data[seq] * 4 + s];
    for (std::int64_t s = 0; s < s_len * 2; ++s) one.v.data[s] = v.data[cu_k.data[seq] * 2 + s];
    const NaiveAttention naive =
        one.naive([&](auto, auto, auto t, auto s) { return tiles.data[(seq * 2 + t / 4) * 3 + s / 3] == 1; });
    const std::vector<double> got(o.data.begin() + cu_q.data[seq] * 4, o.data.begin() + cu_q.data[seq + 1] * 4);
    expect_near(got, naive.o, 1e-12, "packed sequence");
  }
}

TEST(FlashBlockMask, PerHeadWindows) {
  // The spec's example: causal, Tq = 1, Tk = 6, window_left = [2, -1]: head 0 sees keys 3..5, head 1 keys 0..5.
  Call c(1, 1, 6, 2, 1, 4, 2, 6);
  c.causal = true;
  Host<std::int32_t> left({2});
  left.data = {2, -1};
  c.windows.left = left.view();
  c.forward();
  c.backward();
  expect_near(c.o.data, c.naive([](auto, auto h, auto, auto s) { return h == 1 || s >= 3; }).o, 1e-12, "left");
  for (std::int64_t s = 0; s < 3; ++s) {  // keys 0..2 get a gradient from head 1 only
    EXPECT_NE(c.dk.data[s * 4], 0.0);
  }
  // Both sides, per head, against naive per-head windows, non-causal, Tq = 5 vs Tk = 7 and the backward.
  Call w(2, 5, 7, 4, 2, 3, 2, 7), plain(2, 5, 7, 4, 2, 3, 2, 7);
  Host<std::int32_t> l({4}), r({4});
  l.data = {0, 1, -1, 3}, r.data = {2, -1, 0, 1};
  w.windows.left = l.view(), w.windows.right = r.view();
  w.forward();
  w.backward();
  const Keep keep = [&](auto, auto h, auto t, auto s) {
    const std::int64_t a = t + 2;
    return (l.data[h] < 0 || s >= a - l.data[h]) && (r.data[h] < 0 || s <= a + r.data[h]);
  };
  expect_near(w.o.data, w.naive(keep).o, 1e-12, "both sides");
  expect_near(w.lse.data, w.naive(keep).lse, 1e-12, "both sides lse");
  // The gradient through a mask equal to the windows gives the same dq, dk, dv.
  plain.mask = Host<std::uint8_t>({1, 4, 5, 7});
  for (std::int64_t h = 0; h < 4; ++h) {
    for (std::int64_t t = 0; t < 5; ++t) {
      for (std::int64_t s = 0; s < 7; ++s) plain.mask.data[(h * 5 + t) * 7 + s] = keep(0, h, t, s);
    }
  }
  plain.forward();
  plain.backward();
  expect_near(w.dq.data, plain.dq.data, 1e-12, "dq");
  expect_near(w.dk.data, plain.dk.data, 1e-12, "dk");
  expect_near(w.dv.data, plain.dv.data, 1e-12, "dv");
}

TEST(FlashBlockMask, Validation) {
  Call c(2, 10, 10, 2, 1, 4, 2, 8);
  Lists lists;
  Host<std::uint8_t> tiles({1, 1, 3, 3}, 1), tiles_small({1, 1, 2, 3}, 1), tiles_heads({1, 3, 3, 3}, 1);
  Host<std::int32_t> counts_bad({1, 1, 3}, 0), indices_bad({1, 1, 3, 3}, 0), indices_short({1, 2, 3, 3}, 0);
  Host<std::int32_t> windows({2}, 0), windows_short({1}, 0);
  Host<float> counts_f32({1, 1, 3});
  struct Case {
    const char* name;
    std::function<void(FlashAttentionParams&)> edit;
    ErrorKind kind;
    const char* argument;
  };
  const auto with_lists = [&](FlashAttentionParams& p) {
    p.blocks.kv_num_blocks = lists.counts.view(), p.blocks.kv_indices = lists.indices.view();
    p.blocks.block_q = 4, p.blocks.block_k = 4;
  };
  const std::vector<Case> cases = {
      {"no block size", [&](auto& p) { with_lists(p), p.blocks.block_q = 0; }, ErrorKind::config, "block_q"},
      {"negative block_k", [&](auto& p) { with_lists(p), p.blocks.block_k = -4; }, ErrorKind::config, "block_k"},
      {"both forms", [&](auto& p) { with_lists(p), p.blocks.block_mask = tiles.view(); }, ErrorKind::config,
       "block_mask"},
      {"indices alone", [&](auto& p) { with_lists(p), p.blocks.kv_num_blocks = {}; }, ErrorKind::config,
       "kv_num_blocks"},
      {"full alone", [&](auto& p) { with_lists(p), p.blocks.full_kv_num_blocks = lists.counts.view(); },
       ErrorKind::config, "full_kv_indices"},
      {"block_mask dtype", [&](auto& p) { p.blocks.block_mask = lists.indices.view(), p.blocks.block_q = p.blocks.block_k = 4; },
       ErrorKind::dtype, "block_mask"},
      {"block_mask too few tiles",
       [&](auto& p) { p.blocks.block_mask = tiles_small.view(), p.blocks.block_q = p.blocks.block_k = 4; },
       ErrorKind::shape, "block_mask"},
      {"block_mask heads", [&](auto& p) { p.blocks.block_mask = tiles_heads.view(), p.blocks.block_q = p.blocks.block_k = 4; },
       ErrorKind::shape, "block_mask"},
      {"counts dtype", [&](auto& p) { with_lists(p), p.blocks.kv_num_blocks = counts_f32.view(); }, ErrorKind::dtype,
       "kv_num_blocks"},
      {"indices shape", [&](auto& p) { with_lists(p), p.blocks.kv_indices = indices_short.view(); }, ErrorKind::shape,
       "kv_indices"},
      {"count above maxK", [&](auto& p) { with_lists(p), counts_bad.data = {4, 0, 0}, p.blocks.kv_num_blocks = counts_bad.view(); },
       ErrorKind::config, "kv_num_blocks"},
      {"negative count", [&](auto& p) { with_lists(p), counts_bad.data = {0, -1, 0}, p.blocks.kv_num_blocks = counts_bad.view(); },
       ErrorKind::config, "kv_num_blocks"},
      {"index out of range",
       [&](auto& p) { with_lists(p), indices_bad.data = lists.indices.data, indices_bad.data[7] = 3,
                      p.blocks.kv_indices = indices_bad.view(); },
       ErrorKind::config, "kv_indices"},
      {"duplicate index",
       [&](auto& p) { with_lists(p), indices_bad.data = lists.indices.data, indices_bad.data[7] = 1,
                      p.blocks.kv_indices = indices_bad.view(); },
       ErrorKind::config, "kv_indices"},
      {"partial and full overlap",
       [&](auto& p) { with_lists(p), p.blocks.full_kv_num_blocks = lists.counts.view(),
                      p.blocks.full_kv_indices = lists.indices.view(); },
       ErrorKind::config, "full_kv_indices"},
      {"window tensor and int", [&](auto& p) { p.head_windows.left = windows.view(), p.window_left = 3; },
       ErrorKind::config, "window_left"},
      {"window shape", [&](auto& p) { p.head_windows.right = windows_short.view(); }, ErrorKind::shape,
       "window_right"},
      {"window below -1", [&](auto& p) { windows.data = {0, -2}, p.head_windows.left = windows.view(); },
       ErrorKind::config, "window_left"},
      {"window dtype", [&](auto& p) { p.head_windows.left = counts_f32.view(), p.head_windows.left.rank = 1,
                                      p.head_windows.left.shape[0] = 2; },
       ErrorKind::dtype, "window_left"},
      {"block mask on CUDA", [&](auto& p) { with_lists(p), p.blocks.kv_num_blocks = on_cuda(p.blocks.kv_num_blocks); },
       ErrorKind::device, "kv_num_blocks"},
  };
  for (const Case& test : cases) {
    SCOPED_TRACE(test.name);
    FlashAttentionParams p = c.forward_params();
    test.edit(p);
    expect_error([&] { flash_attention(p); }, test.kind, test.argument);
  }
}

TEST(FlashBlockMask, CudaListsRaiseUnsupported) {
  // CUDA takes the dense tile map only: FlexAttention's lists are refused (naming the map to pass) before any launch.
  Call c(1, 4, 4, 1, 1, 8, 8, 9);
  Host<std::int32_t> counts({1, 1, 1}, 1), indices({1, 1, 1, 1}, 0);
  FlashAttentionParams p = c.forward_params();
  for (TensorView* t : {&p.q, &p.k, &p.v, &p.o, &p.lse}) *t = on_cuda(*t);
  p.q.dtype = p.k.dtype = p.v.dtype = p.o.dtype = DType::float16;
  p.lse.dtype = DType::float32;
  p.blocks.kv_num_blocks = on_cuda(counts.view()), p.blocks.kv_indices = on_cuda(indices.view());
  p.blocks.block_q = p.blocks.block_k = 4;
  try {
    flash_attention(p);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::unsupported) << e.what();
  }
}

TEST(FlashBlockMask, Uint8TileStatesEqualTheListsWithFullTiles) {
  // The uint8 map's states (0 absent, 1 exists, 2 full) carry what the partial and full lists do.
  const int kStates[3][3] = {{2, 0, 1}, {1, 2, 0}, {0, 1, 2}};
  for (bool causal : {false, true}) {
    Call dense(1, 10, 12, 2, 1, 8, 4, 11), lists(1, 10, 12, 2, 1, 8, 4, 11);
    std::mt19937_64 rng(5);
    Host<std::uint8_t> mask({1, 2, 10, 12});
    for (auto& x : mask.data) x = static_cast<std::uint8_t>(rng() % 4 != 0);
    Host<std::uint8_t> states({1, 1, 3, 3});
    Host<std::int32_t> counts({1, 1, 3}, 0), indices({1, 1, 3, 3}, 0), full_counts({1, 1, 3}, 0),
        full_indices({1, 1, 3, 3}, 0);
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 3; ++j) {
        states.data[i * 3 + j] = static_cast<std::uint8_t>(kStates[i][j]);
        if (kStates[i][j] == 1) indices.data[i * 3 + counts.data[i]++] = j;
        if (kStates[i][j] == 2) full_indices.data[i * 3 + full_counts.data[i]++] = j;
      }
    }
    for (Call* c : {&dense, &lists}) c->causal = causal, c->mask = mask, c->use_bias();
    TensorView state_view = states.view();
    state_view.dtype = DType::uint8;
    dense.blocks.block_mask = state_view;
    lists.blocks.kv_num_blocks = counts.view(), lists.blocks.kv_indices = indices.view();
    lists.blocks.full_kv_num_blocks = full_counts.view(), lists.blocks.full_kv_indices = full_indices.view();
    for (Call* c : {&dense, &lists}) {
      c->blocks.block_q = 4, c->blocks.block_k = 5;
      c->forward();
      c->backward();
    }
    expect_near(dense.o.data, lists.o.data, 1e-13, "o");
    expect_near(dense.lse.data, lists.lse.data, 1e-13, "lse");
    expect_near(dense.dq.data, lists.dq.data, 1e-12, "dq");
    expect_near(dense.dk.data, lists.dk.data, 1e-12, "dk");
    expect_near(dense.dbias.data, lists.dbias.data, 1e-12, "dbias");
  }
}

}  // namespace
}  // namespace sparseattn::test
