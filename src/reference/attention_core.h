// The one float64 attention routine that flash, compressed and selected attention share. An operation
// describes which keys each query row sees (and optional additive score terms); this file does the
// softmax, the output, the log-sum-exp and the gradients.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "reference/dense.h"

namespace sparseattn::reference {

// Token tensors carry a batch dimension (packed ones a batch of 1, see with_batch_dim):
// q [Bq, Nq, Hq, Dqk], k [Bk, Nk, Hkv, Dqk], v [Bk, Nk, Hkv, Dv]. Sequence `seq` has its queries at
// q_spans[seq] and its keys at k_spans[seq]; query row t and key position s count from the span's start.
// Query head h reads KV head h / (Hq / Hkv).
struct AttentionProblem {
  const Dense& q;
  const Dense& k;
  const Dense& v;
  std::vector<Span> q_spans;
  std::vector<Span> k_spans;
  double scale = 1.0;
  // Fills `keys` (cleared by the callee) with the strictly ascending key positions that query row t of
  // sequence `seq` sees through KV head `kv_head`; shared by the query heads of the group. Called once per
  // row and KV head in a forward or backward pass, possibly from several threads at once.
  std::function<void(std::int64_t seq, std::int64_t t, std::int64_t kv_head, std::vector<std::int64_t>& keys)>
      visible_keys;
  // Optional: adds the additive score terms of query head `head` for the listed keys to scores[i]
  // (scores[i] belongs to keys[i]); -infinity hides a key. Called once per row and query head.
  std::function<void(std::int64_t seq, std::int64_t t, std::int64_t head, const std::vector<std::int64_t>& keys,
                     double* scores)>
      add_scores;
};

struct AttentionOutputs {
  Dense o;    // [Bq, Nq, Hq, Dv]; rows outside the spans stay 0
  Dense lse;  // [Bq, Hq, Nq]; natural log; -inf for a row that sees no key
};

struct AttentionGradients {
  Dense dq;  // like q
  Dense dk;  // like k
  Dense dv;  // like v
};

// Forward: s = scale * q.k + extra terms, lse = log sum exp(s), o = softmax(s) v. A row with no visible
// key (or only -inf scores) gets o = 0 and lse = -inf.
AttentionOutputs attention_forward(const AttentionProblem& problem);

// Backward from the forward's o and lse (same shapes as attention_forward returns) and d_o (like o).
// Rows whose lse is -inf contribute nothing. Deterministic: the split of the work into pieces and the
// order of every sum depend on the shapes only, never on the number of threads.
AttentionGradients attention_backward(const AttentionProblem& problem, const Dense& o, const Dense& lse,
                                      const Dense& d_o);

// The gradient of the loss with respect to the scores of one query row (the gradient of an additive bias):
// fills `keys` with the row's visible keys and ds[i] = p_i (dp_i - sum(d_o * o)) for keys[i]. All zero for
// a row whose lse is -inf. Safe to call from several threads at once.
void score_gradients(const AttentionProblem& problem, const Dense& o, const Dense& lse, const Dense& d_o,
                     std::int64_t seq, std::int64_t t, std::int64_t head, std::vector<std::int64_t>& keys,
                     std::vector<double>& ds);

// The layout of already validated token tensors: packed iff cu_seqlens is present.
detail::TokenLayout token_layout(const TensorView& tokens, const TensorView& cu_seqlens);
// A token tensor (or a log-sum-exp) in float64 with the batch dimension that packed tensors lack.
Dense load_tokens(const TensorView& tokens, bool packed);

// Writes a token tensor's values ([Bd, N, H, D] as above) to `out`: all of it when batched, only the rows
// of the spans when packed, so that packed rows past cu_seqlens[B] stay untouched.
void store_tokens(const Dense& values, const TensorView& out, bool packed, const std::vector<Span>& spans);
// The same for a log-sum-exp ([Bd, H, N]; packed `out` is [H, N]).
void store_lse(const Dense& values, const TensorView& out, bool packed, const std::vector<Span>& spans);

// The inputs of a backward pass (the forward's o and lse, and d_o), loaded once.
struct BackwardInputs {
  Dense o, lse, d_o;
};
BackwardInputs load_backward_inputs(const TensorView& o, const TensorView& lse, const TensorView& d_o, bool packed);

// An operation's whole forward: runs attention_forward and writes o and lse through store_tokens/store_lse.
void attention_forward_into(const AttentionProblem& problem, bool packed, const TensorView& o, const TensorView& lse);
// An operation's whole backward: runs attention_backward and writes dq (query rows), dk and dv (key rows).
void attention_backward_into(const AttentionProblem& problem, const BackwardInputs& inputs, bool packed,
                             const TensorView& dq, const TensorView& dk, const TensorView& dv);

}  // namespace sparseattn::reference
