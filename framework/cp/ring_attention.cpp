// Ring attention (ring_attention.h): the forward's online softmax over the
// blocks that travel the ring, and the backward's ring of blocks and their
// gradients.
#include "framework/cp/ring_attention.h"

#include <torch/autograd.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <vector>

namespace framework::cp {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Adds the wall time of its scope to *total (when total is given).
class Timed {
 public:
  explicit Timed(double* total) : total_(total), start_(Clock::now()) {}
  ~Timed() {
    if (total_ != nullptr) *total_ += seconds_since(start_);
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  double* total_;
  Clock::time_point start_;
};

// A run of a rank's tokens whose positions follow each other: local rows
// [offset, offset + len), positions [first, first + len). Head-tail gives a
// rank two (one where its chunks meet), no balancing one.
struct Segment {
  int64_t offset, first, len;
};

// The runs of `positions` ([Sl] int64 on the CPU).
std::vector<Segment> segments_of(const torch::Tensor& positions) {
  const torch::Tensor p = positions.contiguous();
  const int64_t* v = p.data_ptr<int64_t>();
  std::vector<Segment> out;
  for (int64_t i = 0; i < p.numel(); ++i) {
    if (!out.empty() && v[i] == out.back().first + out.back().len) {
      ++out.back().len;
    } else {
      out.push_back({i, v[i], 1});
    }
  }
  return out;
}

// A piece of a step's work: one segment's queries against one segment's
// keys. Runs of different ranks cover disjoint ranges of positions, so a
// query run sees another rank's key run whole or not at all; only a run
// against itself (the own block) needs the causal mask, and there each
// query sees at least its own key.
struct Tile {
  Segment q, k;
  torch::Tensor visible;  // [q.len, k.len] bool on the device; undefined: every key seen
};

// The tiles of the block `k_segments` for the queries `q_segments`, the
// ones no query sees left out: decided on the host, so a skipped or
// unmasked tile costs no device work.
std::vector<Tile> tiles_of(const std::vector<Segment>& q_segments, const std::vector<Segment>& k_segments,
                           bool causal, const torch::Device& device) {
  std::vector<Tile> out;
  const auto positions = torch::TensorOptions(torch::kLong).device(device);
  for (const Segment& q : q_segments) {
    for (const Segment& k : k_segments) {
      if (!causal || k.first + k.len - 1 <= q.first) {
        out.push_back({q, k, {}});
      } else if (k.first <= q.first + q.len - 1) {
        const torch::Tensor kp = torch::arange(k.first, k.first + k.len, positions);
        const torch::Tensor qp = torch::arange(q.first, q.first + q.len, positions);
        out.push_back({q, k, kp.unsqueeze(0) <= qp.unsqueeze(1)});
      }
    }
  }
  return out;
}

// Rows `s` of t along the sequence dim (3 in every tensor here: [B, Hkv, G,
// S(, D)] and [2, B, Hkv, S, D]): a view.
torch::Tensor rows(const torch::Tensor& t, const Segment& s) { return t.narrow(3, s.offset, s.len); }

// The shapes of one call; queries as [B, Hkv, G, Sl, D] (query head
// kv x G + g reads key/value head kv).
struct Shape {
  int64_t batch, q_heads, kv_heads, group, len, dim;
  std::vector<int64_t> grouped() const { return {batch, kv_heads, group, len, dim}; }
  std::vector<int64_t> rows() const { return {batch, kv_heads, group, len}; }
  std::vector<int64_t> kv_pair() const { return {2, batch, kv_heads, len, dim}; }
};

// Scores of the queries q5 [B, Hkv, G, Sq, D] (fp32) against the keys k
// [B, Hkv, Sk, D] (fp32): [B, Hkv, G, Sq, Sk], masked with -inf where
// `visible` ([Sq, Sk], when defined) is false.
torch::Tensor tile_scores(const torch::Tensor& q5, const torch::Tensor& k, const torch::Tensor& visible,
                          double scale) {
  torch::Tensor s = torch::matmul(q5, k.unsqueeze(2).transpose(-2, -1)) * scale;
  if (visible.defined()) s = s.masked_fill(visible.logical_not(), -kInf);
  return s;
}

// The running state of the forward's online softmax, per query row: the
// maximum score so far, the sum of exp(score - max), and the sum of
// exp(score - max) x value.
struct OnlineSoftmax {
  torch::Tensor row_max, row_sum, acc;

  // Folds in one tile: keys and values kv [2, B, Hkv, Sk, D] for the
  // query rows `q_rows` (q5's rows of tile.q). A row that sees none of the
  // tile keeps its state; its maximum is finite already or becomes so
  // (the own block gives every query at least itself).
  void add(const torch::Tensor& q5, const torch::Tensor& kv, const Tile& tile, double scale) {
    const torch::Tensor k = rows(kv, tile.k)[0].to(torch::kFloat), v = rows(kv, tile.k)[1].to(torch::kFloat);
    torch::Tensor run_max = rows(row_max, tile.q), sum = rows(row_sum, tile.q), out = rows(acc, tile.q);
    const torch::Tensor s = tile_scores(rows(q5, tile.q), k, tile.visible, scale);
    const torch::Tensor new_max = torch::maximum(run_max, std::get<0>(s.max(-1)));
    const torch::Tensor rescale = torch::exp(run_max - new_max);  // the earlier tiles' weight, anew
    const torch::Tensor p = torch::exp(s - new_max.unsqueeze(-1));
    sum.copy_(sum * rescale + p.sum(-1));
    out.copy_(out * rescale.unsqueeze(-1) + torch::matmul(p, v.unsqueeze(2)));
    run_max.copy_(new_max);
  }
};

// Adds one tile's gradients: into dq5 (fp32, [B, Hkv, G, Sl, D]) at the
// tile's query rows, and into grad [2, B, Hkv, Sk, D] (fp32: dk, dv) at its
// key rows. p = exp(s - lse) is the forward's softmax, rebuilt from the
// saved log-sum-exp.
void add_tile_gradients(const torch::Tensor& q5, const torch::Tensor& kv, const torch::Tensor& dout5,
                        const torch::Tensor& lse, const torch::Tensor& delta, const Tile& tile, double scale,
                        const torch::Tensor& dq5, const torch::Tensor& grad) {
  const torch::Tensor k = rows(kv, tile.k)[0].to(torch::kFloat), v = rows(kv, tile.k)[1].to(torch::kFloat);
  const torch::Tensor q = rows(q5, tile.q), dout = rows(dout5, tile.q);
  const torch::Tensor p = torch::exp(tile_scores(q, k, tile.visible, scale) - rows(lse, tile.q).unsqueeze(-1));
  const torch::Tensor dp = torch::matmul(dout, v.unsqueeze(2).transpose(-2, -1));
  const torch::Tensor ds = p * (dp - rows(delta, tile.q).unsqueeze(-1));
  rows(dq5, tile.q).add_(torch::matmul(ds, k.unsqueeze(2)), scale);
  const torch::Tensor g = rows(grad, tile.k);
  g[0].add_(torch::matmul(ds.transpose(-2, -1), q).sum(2), scale);
  g[1].add_(torch::matmul(p.transpose(-2, -1), dout).sum(2));
}

// Message tags: a pair's key/value blocks and gradient blocks never match
// each other's receives, whatever order Gloo delivers them in.
int kv_tag(int64_t step) { return static_cast<int>(2 * step); }
int grad_tag(int64_t step) { return static_cast<int>(2 * step + 1); }

// One hop of the key/value ring, in flight: `held` to the next member,
// the previous member's block into `incoming`.
struct KvHop {
  comm::Work send, recv;
  torch::Tensor incoming;

  void post(comm::Group& group, const torch::Tensor& held, int64_t step) {
    const int size = group.size(), rank = group.rank();
    incoming = torch::empty_like(held);
    send = group.send_async(held, (rank + 1) % size, kv_tag(step));
    recv = group.recv_async(incoming, (rank + size - 1) % size, kv_tag(step));
  }
  torch::Tensor wait(double* wait_s) {
    Timed timed(wait_s);
    recv.wait();
    send.wait();
    return incoming;
  }
};

class RingAttentionFn : public torch::autograd::Function<RingAttentionFn> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& positions,
                               comm::Group* group, bool causal, RingStats* stats) {
    Timed whole(stats != nullptr ? &stats->attention_s : nullptr);
    double* wait_s = stats != nullptr ? &stats->wait_s : nullptr;
    const Shape shape = shape_of(q, k, v, positions, *group);
    const double scale = 1.0 / std::sqrt(static_cast<double>(shape.dim));
    const int64_t size = group->size(), rank = group->rank();
    const torch::Tensor q5 = q.to(torch::kFloat).reshape(shape.grouped());
    const auto fp32 = q.options().dtype(torch::kFloat);
    OnlineSoftmax state{torch::full(shape.rows(), -kInf, fp32), torch::zeros(shape.rows(), fp32),
                        torch::zeros(shape.grouped(), fp32)};
    // Step s holds member (rank - s)'s block: the own block first.
    const std::vector<Segment> mine = segments_of(positions[rank]);
    torch::Tensor held = torch::stack({k, v}).contiguous();
    for (int64_t step = 0; step < size; ++step) {
      KvHop hop;
      if (step + 1 < size) hop.post(*group, held, step);  // the next block travels during this one
      for (const Tile& tile : tiles_of(mine, segments_of(positions[(rank - step + size) % size]), causal, q.device())) {
        state.add(q5, held, tile, scale);
      }
      if (step + 1 < size) held = hop.wait(wait_s);
    }
    const torch::Tensor out = (state.acc / state.row_sum.unsqueeze(-1)).reshape(q.sizes()).to(q.scalar_type());
    const torch::Tensor lse = state.row_max + torch::log(state.row_sum);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["positions"] = positions;
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["stats"] = reinterpret_cast<int64_t>(stats);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const torch::Tensor positions = ctx->saved_data["positions"].toTensor();
    auto* group = reinterpret_cast<comm::Group*>(ctx->saved_data["group"].toInt());
    const bool causal = ctx->saved_data["causal"].toBool();
    auto* stats = reinterpret_cast<RingStats*>(ctx->saved_data["stats"].toInt());
    Timed whole(stats != nullptr ? &stats->attention_s : nullptr);
    double* wait_s = stats != nullptr ? &stats->wait_s : nullptr;
    const Shape shape = shape_of(q, k, v, positions, *group);
    const double scale = 1.0 / std::sqrt(static_cast<double>(shape.dim));
    const int64_t size = group->size(), rank = group->rank();
    const int next = static_cast<int>((rank + 1) % size), prev = static_cast<int>((rank + size - 1) % size);

    const torch::Tensor q5 = q.to(torch::kFloat).reshape(shape.grouped());
    const torch::Tensor dout5 = grads[0].to(torch::kFloat).reshape(shape.grouped());
    const torch::Tensor delta = (dout5 * out.to(torch::kFloat).reshape(shape.grouped())).sum(-1);
    const auto fp32 = q.options().dtype(torch::kFloat);
    torch::Tensor dq5 = torch::zeros(shape.grouped(), fp32);
    const std::vector<Segment> mine = segments_of(positions[rank]);
    torch::Tensor held = torch::stack({k, v}).contiguous();
    // Block j's dk and dv: started on member j at step 0, added to on each
    // member it visits, sent on after each step; after the last step one
    // more hop brings the sum home to member j.
    std::vector<comm::Work> grad_sends;
    torch::Tensor own_grad;
    for (int64_t step = 0; step < size; ++step) {
      KvHop hop;
      if (step + 1 < size) hop.post(*group, held, step);
      comm::Work grad_recv;
      torch::Tensor grad_in;
      if (step > 0) {
        grad_in = torch::empty(shape.kv_pair(), fp32);
        grad_recv = group->recv_async(grad_in, prev, grad_tag(step));
      }
      torch::Tensor grad = torch::zeros(shape.kv_pair(), fp32);
      for (const Tile& tile : tiles_of(mine, segments_of(positions[(rank - step + size) % size]), causal, q.device())) {
        add_tile_gradients(q5, held, dout5, lse, delta, tile, scale, dq5, grad);
      }
      if (step > 0) {
        {
          Timed timed(wait_s);
          grad_recv.wait();
        }
        grad.add_(grad_in);
      }
      if (size > 1) {
        grad_sends.push_back(group->send_async(grad, next, grad_tag(step + 1)));
      } else {
        own_grad = grad;
      }
      if (step + 1 < size) held = hop.wait(wait_s);
    }
    if (size > 1) {
      own_grad = torch::empty(shape.kv_pair(), fp32);
      Timed timed(wait_s);
      group->recv_async(own_grad, prev, grad_tag(size)).wait();
      for (comm::Work& w : grad_sends) w.wait();
    }
    return {dq5.reshape(q.sizes()).to(q.scalar_type()), own_grad[0].to(k.scalar_type()),
            own_grad[1].to(v.scalar_type()), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }

 private:
  static Shape shape_of(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& positions, const comm::Group& group) {
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "ring_attention: q and k must be [B, H, S, D], got ", q.sizes(),
                " and ", k.sizes());
    TORCH_CHECK(k.sizes() == v.sizes(), "ring_attention: k ", k.sizes(), " and v ", v.sizes(), " differ");
    TORCH_CHECK(k.scalar_type() == v.scalar_type(), "ring_attention: k and v dtypes differ");
    const Shape s{q.size(0), q.size(1), k.size(1), 0, q.size(2), q.size(3)};
    TORCH_CHECK(k.size(0) == s.batch && k.size(2) == s.len && k.size(3) == s.dim,
                "ring_attention: k ", k.sizes(), " does not match q ", q.sizes());
    TORCH_CHECK(s.kv_heads > 0 && s.q_heads % s.kv_heads == 0, "ring_attention: ", s.q_heads,
                " query heads are not a multiple of ", s.kv_heads, " key/value heads");
    TORCH_CHECK(positions.dim() == 2 && positions.size(0) == group.size() && positions.size(1) == s.len &&
                    positions.device().is_cpu() && positions.scalar_type() == torch::kLong,
                "ring_attention: positions must be [", group.size(), ", ", s.len, "] int64 on the CPU, got ",
                positions.sizes(), " ", positions.scalar_type(), " on ", positions.device());
    Shape out = s;
    out.group = s.q_heads / s.kv_heads;
    return out;
  }
};

}  // namespace

torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& positions, comm::Group& group, bool causal,
                             RingStats* stats) {
  return RingAttentionFn::apply(q, k, v, positions, &group, causal, stats);
}

}  // namespace framework::cp
