// A direct convolution for thin layers (few input and output channels), stride 1, dilation 1, square kernel.
// oneDNN's cost for such layers hardly follows their channels (docs/export.md): a 7x7 conv1 cost the same
// with 2, 3 or 6 output channels, so removing channels from it bought nothing; this kernel's cost follows them.
// Built on first use by dturbo.native.
//
// out[n, c, h, q] = b[c] + map[c, h, q] + sum_{ci, i, j} w[c, ci, i, j] * xpad[n, ci, h + i, q + j]
//
// map is the optional per-position bias export folds in for removed constant channels (dturbo.export.ops.BiasMap).
// Optionally fused with what follows: a leaky ReLU and a max-pooling (no padding), applied while the image's
// convolution is still in cache, so that the output written is the pooled one.
//
// Register blocking: CB output channels x P output rows x R vectors of a row's columns live in registers (R from
// the row's width, CB from R, P = 3 or 4 where CB * R alone leaves too few independent accumulators to hide the
// FMA latency, e.g. a 2- or 3-channel conv1: 3-7% faster than 2 rows there); every input vector is loaded once for
// the CB channels, every weight once for the P rows and R vectors. Vectors are 16 floats where built for AVX-512
// (32 registers), else 8 (AVX2, 16 registers). Images are split across the intra-op threads.
//
// Small images (a 6x6 conv3/conv4 after two poolings fills 6 of a vector's 16 lanes row by row) are computed
// flat: the padded image's rows laid end to end (row stride w + 2 * pad, no more), and the whole output as one
// "row" of h_out x (w + 2 * pad) positions, where output (h, q) sits at h * (w + 2 * pad) + q and tap (i, j)
// reads the input at that position + i * (w + 2 * pad) + j: the same loop, over 3 vectors (75% of the lanes) for
// a 6x6 image instead of 6 rows of one. The positions q >= w_out of each row (they read into the next row) are
// computed and never kept.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

namespace {

// GCC/Clang vector extensions: the compiler emits the widest instructions the build targets.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
typedef float vec __attribute__((vector_size(64)));
// Output channels per pass over the input rows, by vectors per row: 16-18 accumulators of the 32 registers (18 for
// rows of 3 vectors: 17 channels then take 3 passes instead of 4).
constexpr int channels_for(int r) { return r == 1 ? 16 : r == 2 ? 8 : r == 3 ? 6 : 4; }
#else
constexpr int64_t kLanes = 8;
typedef float vec __attribute__((vector_size(32)));
// 8 to 12 accumulators of the 16 registers.
constexpr int channels_for(int r) { return r == 1 ? 8 : r == 2 ? 4 : r == 3 ? 4 : 3; }
#endif
constexpr int kMaxVectors = 4;  // vectors of one output row held at once

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));  // unaligned
  return v;
}

// max as torch's max-pooling takes it, lane by lane: a NaN wins (once m is NaN, neither test replaces it).
inline vec nan_max(vec m, vec v) { return (v > m) | (v != v) ? v : m; }

struct Rows {             // where one register block reads and writes
  const float* img;       // the padded image at its first channel, at the block's first input row and column
  int64_t ld_img, plane;  // floats between input rows, between input channels
  int64_t cin, k;
  const float* w;         // w[c0, 0, 0, 0]
  const float* init;      // bias (+ map) of channel c0 at the block's output row and column, as conv's layout
  float* out;             // conv's channel c0 at the block's output row and column
  int64_t ld_row, ld_out; // floats between rows, between channels of init and out
  bool act;
  float slope;
};

// R vectors of columns of P output rows for CB channels, for a kernel of K x K taps (K = 0: a.k, known at run
// time; the common sizes are compiled apart so that the tap loops unroll). With act, the leaky ReLU (x if x > 0
// else slope * x, as torch's) is applied in registers.
template <int CB, int R, int P, int K>
void row_block(const Rows& a) {
  const int64_t k = K ? K : a.k, kk = k * k, ldw = a.cin * kk;
  vec acc[CB][P][R];
  for (int c = 0; c < CB; ++c)
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < R; ++r) acc[c][p][r] = load(a.init + c * a.ld_out + p * a.ld_row + r * kLanes);
  for (int64_t ci = 0; ci < a.cin; ++ci) {
    for (int64_t i = 0; i < k; ++i) {
      const float* src = a.img + ci * a.plane + i * a.ld_img;
      const float* wr = a.w + ci * kk + i * k;
      for (int64_t j = 0; j < k; ++j) {
        vec v[P][R];
        for (int p = 0; p < P; ++p)
          for (int r = 0; r < R; ++r) v[p][r] = load(src + p * a.ld_img + j + r * kLanes);
        for (int c = 0; c < CB; ++c) {
          const float wv = wr[c * ldw + j];
          for (int p = 0; p < P; ++p)
            for (int r = 0; r < R; ++r) acc[c][p][r] += wv * v[p][r];
        }
      }
    }
  }
  for (int c = 0; c < CB; ++c)
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < R; ++r) {
        if (a.act) acc[c][p][r] = acc[c][p][r] > 0.f ? acc[c][p][r] : acc[c][p][r] * a.slope;
        std::memcpy(a.out + c * a.ld_out + p * a.ld_row + r * kLanes, &acc[c][p][r], sizeof(vec));
      }
}

// Output rows one block computes: enough for at least 8 accumulators (2 FMA units x 4 cycles of latency), up to
// 4 rows (each input vector is loaded once per row and serves the block's cb channels whatever the rows).
constexpr int rows_for(int cb, int r) { return cb * r >= 8 ? 1 : cb * r >= 6 ? 3 : 4; }

template <int CB, int R, int P>
void row_block_k(const Rows& a) {
  switch (a.k) {
    case 3: return row_block<CB, R, P, 3>(a);
    case 5: return row_block<CB, R, P, 5>(a);
    case 7: return row_block<CB, R, P, 7>(a);
    default: return row_block<CB, R, P, 0>(a);
  }
}

// row_block<cb, R, rows_for(cb, R) or 1> for a run-time cb <= CB (the last channels of a layer whose count CB does
// not divide); one row where fewer than rows_for are left (the last rows of the image).
template <int R, int CB = channels_for(R)>
void row_block_any(int64_t cb, bool all_rows, const Rows& a) {
  if constexpr (CB >= 1) {
    if (cb != CB) return row_block_any<R, CB - 1>(cb, all_rows, a);
    if constexpr (rows_for(CB, R) > 1)
      if (all_rows) return row_block_k<CB, R, rows_for(CB, R)>(a);
    return row_block_k<CB, R, 1>(a);
  }
}

int64_t rows_per_block(int64_t vectors, int64_t cb) {
  return rows_for(static_cast<int>(cb), static_cast<int>(vectors));
}

void run_block(int64_t vectors, int64_t cb, bool all_rows, const Rows& a) {
  switch (vectors) {
    case 1: return row_block_any<1>(cb, all_rows, a);
    case 2: return row_block_any<2>(cb, all_rows, a);
    case 3: return row_block_any<3>(cb, all_rows, a);
    default: return row_block_any<4>(cb, all_rows, a);
  }
}

at::Tensor conv_direct(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& b_in,
                       const std::optional<at::Tensor>& map_in, int64_t pad, std::optional<double> slope,
                       int64_t pool_k, int64_t pool_s) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 4,
              "conv_direct: x must be a float32 CPU tensor (N, C_in, H, W), got ", x_in.sizes());
  TORCH_CHECK(w_in.scalar_type() == at::kFloat && w_in.dim() == 4 && w_in.size(1) == x_in.size(1) &&
                  w_in.size(2) == w_in.size(3),
              "conv_direct: w must be float32 (C, C_in, K, K) with x's C_in = ", x_in.size(1), ", got ",
              w_in.sizes());
  TORCH_CHECK(b_in.scalar_type() == at::kFloat && b_in.dim() == 1 && b_in.size(0) == w_in.size(0),
              "conv_direct: b must be float32 (C,), got ", b_in.sizes());
  TORCH_CHECK(pad >= 0, "conv_direct: padding must be >= 0");
  TORCH_CHECK(pool_k >= 0 && (pool_k == 0 || pool_s >= 1), "conv_direct: pooling needs kernel >= 1, stride >= 1");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), b = b_in.contiguous();
  const int64_t n_img = x.size(0), cin = x.size(1), h_in = x.size(2), w_in_ = x.size(3);
  const int64_t ch = w.size(0), k = w.size(2);
  const int64_t h_conv = h_in + 2 * pad - k + 1, w_conv = w_in_ + 2 * pad - k + 1;
  TORCH_CHECK(h_conv > 0 && w_conv > 0, "conv_direct: kernel larger than the padded input");
  if (map_in.has_value())
    TORCH_CHECK(map_in->scalar_type() == at::kFloat && map_in->numel() == ch * h_conv * w_conv,
                "conv_direct: the bias map must be float32 (C, H_out, W_out) = (", ch, ", ", h_conv, ", ", w_conv,
                "), got ", map_in->sizes());
  // Max-pooling without padding (floor mode), as torch.nn.MaxPool2d(pool_k, pool_s).
  const int64_t h_out = pool_k ? (h_conv - pool_k) / pool_s + 1 : h_conv;
  const int64_t w_out = pool_k ? (w_conv - pool_k) / pool_s + 1 : w_conv;
  TORCH_CHECK(h_out > 0 && w_out > 0, "conv_direct: pooling window larger than the convolution's output");
  // Row by row: each row's columns in `vectors` vectors (blocks of them where the row is wider), rows padded to
  // blocks. Flat (small images, see above): one block of `vectors` vectors over every row.
  const int64_t row_vectors = (w_conv + kLanes - 1) / kLanes;
  const int64_t ld_flat = w_in_ + 2 * pad, flat_span = (h_conv - 1) * ld_flat + w_conv;
  const int64_t flat_vectors = (flat_span + kLanes - 1) / kLanes;
  const bool flat = flat_vectors <= kMaxVectors && flat_vectors < h_conv * row_vectors;  // fewer lanes idle
  const int64_t vectors = flat ? flat_vectors : std::min<int64_t>(kMaxVectors, row_vectors);
  const int64_t cols = vectors * kLanes, blocks = flat ? 1 : (w_conv + cols - 1) / cols, w_round = blocks * cols;
  const int64_t cb_max = channels_for(static_cast<int>(vectors));
  const int64_t h_pad = h_in + 2 * pad;
  const int64_t ld_img = flat ? ld_flat : w_round + k - 1;  // row by row: wide enough for the last block's loads
  const int64_t ld_row = flat ? ld_flat : w_round;          // floats between output rows of conv and init
  const int64_t row_blocks = flat ? 1 : h_conv;             // output rows the blocks start at (times the step)
  const int64_t ld_conv = flat ? cols : h_conv * w_round;   // floats between channels of conv and init
  // Each output's starting value, bias plus map, in the convolution's padded layout (read by every image).
  std::vector<float> init(ch * ld_conv, 0.f);
  {
    const float* bs = b.data_ptr<float>();
    const at::Tensor map = map_in.has_value() ? map_in->contiguous() : at::Tensor();
    const float* ms = map.defined() ? map.data_ptr<float>() : nullptr;
    for (int64_t c = 0; c < ch; ++c)
      for (int64_t h = 0; h < h_conv; ++h)
        for (int64_t q = 0; q < w_conv; ++q)
          init[c * ld_conv + h * ld_row + q] = bs[c] + (ms ? ms[(c * h_conv + h) * w_conv + q] : 0.f);
  }
  const bool act = slope.has_value();
  const float neg = act ? static_cast<float>(*slope) : 1.f;
  at::Tensor out = at::empty({n_img, ch, h_out, w_out}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* ws = w.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, n_img, 8, [&](int64_t n0, int64_t n1) {
    // The zero-padded image; its border stays zero (+ a flat block's loads past the last channel's end).
    std::vector<float> img(cin * h_pad * ld_img + kLanes + k, 0.f);
    // One image's convolution (rows padded to blocks; + the pooling's loads past the last row's end).
    std::vector<float> conv(ch * ld_conv + kLanes + pool_k, 0.f);
    // Maxima over the pooling window's rows at every column, one row per pooled row (+ the columns' loads past
    // a row's end), then over its columns.
    const int64_t ld_tall = (row_vectors + 1) * kLanes;
    std::vector<float> tall(h_out * ld_tall + pool_k, 0.f), wins(row_vectors * kLanes);
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t ci = 0; ci < cin; ++ci)
        for (int64_t h = 0; h < h_in; ++h) {
          const float* row = xs + ((n * cin + ci) * h_in + h) * w_in_;
          std::copy(row, row + w_in_, img.data() + (ci * h_pad + h + pad) * ld_img + pad);
        }
      for (int64_t c0 = 0; c0 < ch; c0 += cb_max) {
        const int64_t cb = std::min(cb_max, ch - c0);
        const int64_t step = rows_per_block(vectors, cb);
        for (int64_t h = 0, rows; h < row_blocks; h += rows) {
          rows = h + step <= row_blocks ? step : 1;
          for (int64_t blk = 0; blk < blocks; ++blk) {
            const int64_t at = c0 * ld_conv + h * ld_row + blk * cols;
            const Rows a{img.data() + h * ld_img + blk * cols, ld_img, h_pad * ld_img, cin, k,
                         ws + c0 * cin * k * k, init.data() + at, conv.data() + at, ld_row, ld_conv, act, neg};
            run_block(vectors, cb, rows == step, a);
          }
        }
      }
      // The pooling while the image's convolution is still in cache (the separate layers would each pass over it
      // in memory again), separable and vectorised over the columns: the maximum over the window's rows at every
      // column, for every pooled row; then over the window's columns; every pool_s-th of those kept. The second
      // pass reads back rows stored a whole pass earlier: no store-to-load forwarding stall, as reading a row just
      // stored would cost. Columns past the convolution's width only reach windows past the output's: never kept.
      for (int64_t c = 0; c < ch; ++c) {
        const float* cv = conv.data() + c * ld_conv;
        float* o = os + (n * ch + c) * h_out * w_out;
        if (!pool_k) {
          for (int64_t h = 0; h < h_out; ++h) std::copy(cv + h * ld_row, cv + h * ld_row + w_out, o + h * w_out);
          continue;
        }
        for (int64_t ph = 0; ph < h_out; ++ph) {
          const float* first = cv + ph * pool_s * ld_row;
          for (int64_t q = 0; q < w_conv; q += kLanes) {
            vec m = load(first + q);
            for (int64_t i = 1; i < pool_k; ++i) m = nan_max(m, load(first + i * ld_row + q));
            std::memcpy(tall.data() + ph * ld_tall + q, &m, sizeof(vec));
          }
        }
        for (int64_t ph = 0; ph < h_out; ++ph) {
          const float* row = tall.data() + ph * ld_tall;
          for (int64_t q = 0; q < w_conv; q += kLanes) {
            vec m = load(row + q);
            for (int64_t j = 1; j < pool_k; ++j) m = nan_max(m, load(row + q + j));
            std::memcpy(wins.data() + q, &m, sizeof(vec));
          }
          for (int64_t pw = 0; pw < w_out; ++pw) o[ph * w_out + pw] = wins[pw * pool_s];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(dturbo_kernels, m) {
  m.def("conv_direct(Tensor x, Tensor w, Tensor b, Tensor? bias_map, int pad, float? slope=None, int pool_k=0, "
        "int pool_s=1) -> Tensor");
}
TORCH_LIBRARY_IMPL(dturbo_kernels, CPU, m) { m.impl("conv_direct", conv_direct); }
